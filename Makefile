# Every target creates the virtualenv if missing and installs the pinned project into it, with
# every extra ('.[dev]': train, bench, protogen and the test tools). A serving install is
# `pip install .` alone; see pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
STORE ?= model_store
PYTEST_ARGS ?=
# pytest processes for `make test` (pytest-xdist, one test module per process at a time, so a
# module's shared server stays one server). Most of the suite waits on servers starting and on
# timeouts running out, so two processes take the 2-core machine's run from ~16 to ~11 minutes.
# The tests marked `serial` (latency bounds) run after, alone (scripts/run_tests.sh).
# `TEST_WORKERS=0` runs the first pass in one process too (what `-x` or a debugger wants).
TEST_WORKERS ?= 2

.PHONY: attacks bench-startup venv protos java k8s-tools promtool triton-venv kserve-venv models models-full serve serve-torchserve test test-unit test-experiments lint format clean loadtest bench bench-scaling quickbench fuzz gpu-check image image-gpu image-test

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# gRPC stubs are generated from proto/ (never committed, never hand-edited); a no-op when fresh.
protos: $(STAMP)
	$(PY) -m mariner.server.protogen

java:
	bash scripts/ensure_java.sh

# kubectl renders the kustomizations in the manifest tests (offline; no cluster needed).
k8s-tools:
	bash scripts/ensure_kubectl.sh

# promtool lints the live /metrics exposition in the tests (binary only, into .tools/bin).
promtool:
	bash scripts/ensure_promtool.sh

# tritonclient has its own venv: it needs protobuf < 7, and its `inference` stubs clash with ours.
triton-venv:
	PYTHON=$(PYTHON) bash scripts/ensure_triton_venv.sh

# KServe's SDK has its own venv too: it pins its own fastapi/pydantic/protobuf stack.
kserve-venv:
	PYTHON=$(PYTHON) bash scripts/ensure_kserve_venv.sh

# The store is rebuilt when the training code or a handler changes. The default store holds every
# digits variant and the quick-to-build minilm/resnet18 variants; `models-full` adds their slow
# exports (AOTInductor, compiled, PT2E int8: minutes here) into the same store.
models: $(STORE)/index.json

$(STORE)/index.json: $(STAMP) $(wildcard training/*.py) $(wildcard training/*/*.py) $(wildcard handlers/*.py)
	$(PY) -m mariner.training.pipeline --store $(STORE)

models-full: $(STAMP)
	$(PY) -m mariner.training.pipeline --store $(STORE) --full

serve: models protos
	$(VENV)/bin/mariner serve --model-store $(STORE) --models all

serve-torchserve: models java
	$(PY) -m mariner.loadtest.bench serve-torchserve --model-store $(STORE) --models all

# Locust against a Mariner it starts on 127.0.0.1 (bounded in users and seconds); exits non-zero
# when p99 > LOADTEST_P99_MS or more than 1% of requests fail. Reports: build/loadtest/.
LOADTEST_USERS ?= 8
LOADTEST_SECONDS ?= 20
LOADTEST_P99_MS ?= 50
loadtest: models protos
	$(PY) -m mariner.loadtest.gate --store $(STORE) --users $(LOADTEST_USERS) --run-time $(LOADTEST_SECONDS) --p99-ms $(LOADTEST_P99_MS)

# Raw model vs Mariner vs stock TorchServe (and mosec, an HTTP peer, when the bench extra installed
# it) side by side over unary gRPC, HTTP and the two gRPC streams, the busiest level 3 times
# interleaved (about 10 min here): bench/results.md + PNGs. BENCH_ARGS adds options, e.g.
# BENCH_ARGS='--mariner-args "--frontends 2"'. MODEL=minilm_onnx (any archive stem in the store)
# benchmarks that archive instead -> bench/results-<model>.md.
MODEL ?= digits_torchscript
BENCH_ARGS ?=
bench: models protos java
	-bash scripts/ensure_perf_analyzer.sh
	$(PY) -m mariner.loadtest.bench --model $(MODEL) $(BENCH_ARGS)

# Start-up of an archive naming a TorchServe built-in handler (base_handler), Mariner against
# stock TorchServe, 3 interleaved rounds; prints the medians and their ratio.
bench-startup: $(STAMP) java
	$(PY) -m mariner.loadtest.experiments.startup --rounds 3

# Mariner alone at 64 clients: frontends 1/2 x workers 1/2 (bench/scaling.md).
bench-scaling: models protos
	$(PY) -m mariner.loadtest.bench --scaling $(BENCH_ARGS)

# One sequential client: Mariner vs stock TorchServe vs the bare transport floor.
quickbench: models protos java
	$(PY) -m mariner.loadtest.bench quick

# Hypothesis fuzzing of a live server (>= 10,000 examples); prints the answers counted by status.
MARINER_FUZZ_EXAMPLES ?= 10000
fuzz: venv protos models
	MARINER_FUZZ_EXAMPLES=$(MARINER_FUZZ_EXAMPLES) $(PY) -m tests.fuzz_main $(PYTEST_ARGS)

# The attacks the process model was hardened against, replayed against real servers on 127.0.0.1
# (bounded in count and time; about 2.5 minutes here), with the victims' latency under each flood
# printed: worker budget and lifecycle races, gRPC connection/stream limits, rapid reset and an
# unauthenticated flood, slow HTTP heads and bodies, drain, trust (work dir, peers, frames),
# secrets, parent death, register input, archive bombs (YAML alias bombs included), the bytes a
# frontend holds, requirements files that reach beyond packages, and handler statuses HTTP cannot
# carry. They are part of `make test` too.
ATTACK_TESTS := tests/integration/test_lifecycle_races.py tests/integration/test_listener_limits.py \
	tests/e2e/test_drain.py tests/integration/test_trust.py tests/integration/test_secrets_env.py \
	tests/e2e/test_parent_death.py tests/integration/test_register_input.py tests/unit/test_archive_bombs.py \
	tests/integration/test_held_bytes.py tests/integration/test_http_limits.py \
	tests/integration/test_bad_archives.py tests/unit/test_requirements.py \
	tests/integration/test_model_requirements.py tests/integration/test_runtime_handlers.py
attacks: venv protos models
	$(PY) -m pytest -s -q $(ATTACK_TESTS) $(PYTEST_ARGS)

# The GPU checklist (on a machine with an NVIDIA GPU; under 8 minutes): every archive on CUDA vs
# CPU eager, no recompiles after warm-up, the out-of-memory split, `mariner serve --require-gpu`,
# a short benchmark -> bench/results-gpu.md. GPU_CHECK_ARGS="--device cpu --quick" is CI's dry run.
GPU_CHECK_ARGS ?=
gpu-check: models protos
	$(PY) -m mariner.loadtest.gpu_check $(GPU_CHECK_ARGS)

# Style, the import rules between layers ([tool.importlinter]) and the types ([tool.mypy]); all
# configured in pyproject.toml. Every check runs even when an earlier one fails, so one run
# reports everything; the target fails if any did.
lint: venv protos
	@rc=0; \
	$(VENV)/bin/ruff check . || rc=1; \
	$(VENV)/bin/ruff format --check . || rc=1; \
	$(VENV)/bin/lint-imports || rc=1; \
	$(VENV)/bin/mypy || rc=1; \
	exit $$rc

# The fast tests: in-process, with fakes; no Java, model store, kubectl, promtool or side venvs
# (the one there that needs the store is marked integration, the slowest are marked slow; `make
# test` runs them all).
test-unit: venv protos
	$(PY) -m pytest tests/unit -m "not slow and not integration" $(PYTEST_ARGS)

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The checks of built images (marked `image`) are left to image-test, which builds them first: an
# image left by an earlier build holds other sources, and checking it would judge old code.
test: venv protos java k8s-tools promtool triton-venv kserve-venv models lint
	bash scripts/run_tests.sh $(PY) $(TEST_WORKERS) $(PYTEST_ARGS)

# The one-off measurement tools of loadtest/experiments/ (not the product's): their own target,
# which CI runs after `make test`.
test-experiments: venv protos
	$(PY) -m pytest tests/experiments $(PYTEST_ARGS)

clean:
	rm -rf build $(STORE)/*.mar $(STORE)/index.json $(STORE)/report

# Container images with podman, no registry needed (scripts/image_build.sh): a local Debian 12 base is
# made once (build/image/debian-base-<key>.tar), the host's pip settings are passed in at build time. Tags:
# localhost/mariner:<version>, localhost/mariner-models:<version>, localhost/mariner-gpu:<version>,
# the references the kustomize overlays name.
image: models
	PYTHON=$(PY) bash scripts/image_build.sh cpu

image-gpu:
	PYTHON=$(PY) bash scripts/image_build.sh gpu

# Starts the CPU image as the CPU overlay's Deployment would (probes, predictions over HTTP and gRPC
# with tokens, /metrics, SIGTERM), then as KServe's TorchServe runtime would (`torchserve --start`
# args, KServe v1/v2 on 8080), and runs the tests that compare the manifests with the built images.
# Not part of `make test`, which never needs an image.
image-test: image k8s-tools
	$(PY) -m tests.image.image_check
	$(PY) -m tests.image.kserve_torchserve_check
	$(PY) -m pytest -m image tests/image $(PYTEST_ARGS)
