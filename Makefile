# Every target creates the virtualenv if missing and installs the pinned project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
STORE ?= model_store
PYTEST_ARGS ?=

.PHONY: venv protos java k8s-tools triton-venv models serve serve-torchserve test lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# gRPC stubs are generated from proto/ (never committed, never hand-edited); a no-op when fresh.
protos: $(STAMP)
	$(PY) -m server.protogen

java:
	bash scripts/ensure_java.sh

# kubectl renders the kustomizations in the manifest tests (offline; no cluster needed).
k8s-tools:
	bash scripts/ensure_kubectl.sh

# tritonclient has its own venv: it needs protobuf < 7, and its `inference` stubs clash with ours.
triton-venv:
	PYTHON=$(PYTHON) bash scripts/ensure_triton_venv.sh

# The store is rebuilt when the training code or the handler changes.
models: $(STORE)/index.json

$(STORE)/index.json: $(STAMP) $(wildcard training/*.py) handlers/digits_handler.py
	$(PY) -m training.pipeline --store $(STORE)

serve: models protos
	$(VENV)/bin/mariner serve --model-store $(STORE) --models all

serve-torchserve: models java
	$(PY) -m loadtest.stock_torchserve --model-store $(STORE) --models all

lint: venv protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: venv protos java k8s-tools triton-venv models lint
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf build $(STORE)/*.mar $(STORE)/index.json $(STORE)/report
