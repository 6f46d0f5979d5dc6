# Two commands matter: `make serve` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TINY_MODEL := models/tiny-glm4
# The tiny model's 4-bit weight-only copy (serve_app/ops/quantise_w4a16.py), for the quantised-serving test.
TINY_W4A16 := models/tiny-glm4-w4a16
STAMP := $(VENV)/.installed
PACKAGES := $(VENV)/.packages
# Folders of installed packages whose bytecode `make install` does not compile: 8,000 of 26,000
# files, all but 2 of them read by no process in a clean-clone `.ci/run` (2026-11-29: anthropic's
# SDK, numba, Ray's RLlib/Data/Train/Tune/LLM, transformers' other models, tests; docs/testing.md).
COMPILE_SKIP := /site-packages/(anthropic|numba|sentry_sdk|pyasn1_modules|dns|mcp|mypyc|virtualenv|ray/(rllib|data|train|tune|llm)|transformers/models/(?!(auto|glm|llama|gemma|gpt2|qwen[0-9_]*|deepseek_v[23]|t5|whisper|encoder_decoder)/))/|/tests/
# The Kubernetes security scanner (pyproject.toml's `scan` group), in an environment of its own.
SCAN_VENV := .venv-scan
SCAN_STAMP := $(SCAN_VENV)/.installed
# LangChain and instructor (pyproject.toml's `clients` group), for the structured-output client test.
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
# The serve config `make serve` runs: the CPU engine by default; deploy/config.sim.yaml
# is the production shape on the simulated engine.
CONFIG ?= deploy/config.cpu.yaml

.PHONY: install serve test lint unit e2e bench bench-cost tiny-model servers k8s-sync lock proto clean

install: $(STAMP)

# uv (pyproject.toml's `lock` group), in an environment of its own: it installs the others, with
# pip's package sources (tools/uv_pip.py), and writes requirements/gpu.lock (`make lock`).
UV_VENV := .venv-lock
UV := $(UV_VENV)/bin/uv
UV_PIP := $(PYTHON) tools/uv_pip.py $(UV)
# The `lock` group's one pin (Python's own pip, which installs it here, predates dependency groups).
UV_REQUIREMENT := $(shell sed -n 's/^lock = \["\([^"]*\)"\]/\1/p' pyproject.toml)

$(UV): pyproject.toml
	test -x $(UV_VENV)/bin/python || $(PYTHON) -m venv --without-pip $(UV_VENV)
	$(PYTHON) -m pip --python $(UV_VENV)/bin/python install --quiet '$(UV_REQUIREMENT)'
	touch $(UV)

# The packages, as uv installs them (no bytecode): what mypy, the tiny model and its 4-bit copy
# need, so they run beside the bytecode's compile (CI's `make --jobs`).
$(PACKAGES): pyproject.toml $(UV)
	test -x $(BIN)/python || $(UV) venv --quiet --seed --python $(PYTHON) $(VENV)
	$(UV_PIP) $(BIN)/python install --quiet -e '.[cpu,test]'
	# PyPI's torchvision/torchaudio/torchcodec do not match torch+cpu and break transformers' GLM import.
	$(UV) pip uninstall --quiet --python $(BIN)/python torchvision torchaudio torchcodec
	touch $(PACKAGES)

# The bytecode pip would write, on every core, but for the folders no process of the app or the
# suite imports (COMPILE_SKIP), which Python compiles on first use if one ever does; and the app's
# own package's, which no install writes (where PYTHONDONTWRITEBYTECODE is set, as on the CI machine,
# every replica, engine and checker process compiled its 60-odd modules again). A file only a newer
# Python parses (torch has one) is skipped, as pip skips it.
$(STAMP): $(PACKAGES)
	$(BIN)/python -m compileall -qq -j 0 -x '$(COMPILE_SKIP)' "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" serve_app || true
	touch $(STAMP)

# requirements/gpu.lock: every dependency of the GPU image (the `gpu` extra, Linux x86-64,
# Python 3.11), pinned with its hashes; the Dockerfile installs it with --require-hashes.
# Run after changing a pin in pyproject.toml; a test fails while the two disagree.
lock: $(UV)
	$(UV) pip compile --quiet --native-tls pyproject.toml --extra gpu --generate-hashes --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" -o requirements/gpu.lock

$(SCAN_STAMP): pyproject.toml $(UV)
	test -x $(SCAN_VENV)/bin/python || $(UV) venv --quiet --python $(PYTHON) $(SCAN_VENV)
	$(UV_PIP) $(SCAN_VENV)/bin/python install --quiet --group scan
	touch $(SCAN_STAMP)

$(CLIENTS_STAMP): pyproject.toml $(UV)
	test -x $(CLIENTS_VENV)/bin/python || $(UV) venv --quiet --python $(PYTHON) $(CLIENTS_VENV)
	$(UV_PIP) $(CLIENTS_VENV)/bin/python install --quiet --group clients
	touch $(CLIENTS_STAMP)

tiny-model: $(TINY_MODEL)/tiny_model.json $(TINY_W4A16)/config.json

$(TINY_MODEL)/tiny_model.json: $(PACKAGES) tools/tiny_model.py serve_app/glm4/format.py serve_app/glm4/chat_template.jinja
	$(BIN)/python -m tools.tiny_model $(TINY_MODEL) --force

$(TINY_W4A16)/config.json: $(TINY_MODEL)/tiny_model.json serve_app/ops/quantise_w4a16.py
	rm -rf $(TINY_W4A16)
	$(BIN)/python -m serve_app.ops.quantise_w4a16 $(TINY_MODEL) $(TINY_W4A16)

# A local Ray head with its Prometheus endpoint on 8080, as on KubeRay pods; stopped when serve run ends.
# Token authentication is on, as in production, whatever ran before: the token is
# ~/.ray/auth_token (created here if absent), and Ray's own commands need RAY_AUTH_MODE=token.
# Ray starts with Serve's cluster settings from deploy/cluster.env. One line says when the app can answer.
# A config that keeps stored responses in Redis (deploy/config.sim.yaml) gets a Redis of this
# machine's (Debian's, `make servers`), stopped with the app, unless the environment names one;
# a line says where they live.
SERVE_REDIS := $(VENV)/responses-redis
serve: export RAY_AUTH_MODE = token
serve: install tiny-model
	$(BIN)/ray get-auth-token --generate > /dev/null
	umask 077; $(BIN)/python -m tools.local_redis start $(CONFIG) $(SERVE_REDIS) > $(SERVE_REDIS).env
	env $$($(BIN)/python -m tools.cluster_env) $$(cat $(SERVE_REDIS).env) \
		$(BIN)/ray start --head --metrics-export-port=8080 --disable-usage-stats \
		|| { $(BIN)/python -m tools.local_redis stop $(SERVE_REDIS); exit 1; }
	trap '$(BIN)/ray stop; $(BIN)/python -m tools.local_redis stop $(SERVE_REDIS)' EXIT INT TERM; \
	$(BIN)/python -m tools.ready_line $(CONFIG) & \
	env $$($(BIN)/python -m tools.cluster_env) $(BIN)/serve run --address auto $(CONFIG)

# Debian's Prometheus and Redis, which the tests start (apt, as root or with sudo).
servers:
	tools/install-servers


# The whole suite: the unit tests (on both cores) and the end-to-end tests (one Ray cluster of their
# own, shared), two pytest runs that share nothing. `make test` runs them one after the other; the
# end-to-end tests on a Ray cluster of their own (marked own_cluster: none of the suite's
# applications) then run with the unit tests. Under `make --jobs test` (CI) the end-to-end suite
# starts its applications and runs its busiest modules first, alone; then the unit tests run beside
# its quieter modules, which wait on timers more, and its tests marked `alone` wait for their end:
# files named by SUITE_MARKS tell each run where the other is (made whatever the run's result; make
# fails the goal if either failed). Each run collects only its own files: collecting the other half
# cost 7-17 s of CPU first.
test: unit e2e

OWN_CLUSTER_TESTS := $(shell grep -l "pytest.mark.own_cluster" tests/e2e/test_*.py)

ifneq ($(filter test,$(MAKECMDGOALS)),)
SUITE_MARKS := $(shell mktemp -u /tmp/glm4-test-run.XXXXXX)
WAIT_TO_START := timeout 1200 sh -c 'until test -e $(SUITE_MARKS).unit-start; do sleep 1; done' || true
endif

# Beside the end-to-end suite, the unit tests run at the priority Ray gives its workers (Ray's
# worker_niceness, 15): at the default 0 they took the cores from the suite's replicas, Serve's
# controller and Ray's metrics agent whenever both wanted them (docs/testing.md).
UNIT_NICENESS := 15

unit: install tiny-model $(SCAN_STAMP) servers
	$(if $(SUITE_MARKS),@case '$(MAKEFLAGS)' in (*-j*) $(WAIT_TO_START);; esac)
	$(if $(SUITE_MARKS),nice -n $(UNIT_NICENESS)) $(BIN)/python -m pytest -v --durations=0 -n 2 \
		$(if $(SUITE_MARKS),$(OWN_CLUSTER_TESTS)) tests/unit tests/repo; status=$$?; \
	$(if $(SUITE_MARKS),touch $(SUITE_MARKS).unit-ended;) exit $$status

e2e: install tiny-model $(CLIENTS_STAMP) servers
	$(if $(SUITE_MARKS),E2E_UNIT_START=$(SUITE_MARKS).unit-start E2E_AFTER_UNIT_TESTS=$(SUITE_MARKS).unit-ended) \
	$(BIN)/python -m pytest -v --durations=0 tests/e2e $(if $(SUITE_MARKS),-m "not own_cluster"); status=$$?; \
	$(if $(SUITE_MARKS),touch $(SUITE_MARKS).unit-start;) exit $$status

lint: $(PACKAGES)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Load benchmark of the app `make serve` runs (start it first, in another terminal).
bench: install
	$(BIN)/python -m benchmarks.load --model glm-4-9b-chat --concurrency 1 16 64 --out bench.json --plot bench.png

# The serving layer's cost against vLLM's own front end, three runs in a row on the simulated engine,
# each side alone (about 5 minutes a run); rewrites docs/performance.md's current-figures table.
bench-cost: install
	$(BIN)/python -m benchmarks.cost_record --runs 3 --out-dir bench/cost --docs docs/performance.md

# Write deploy/config.single-gpu.yaml and copy the serve configs into the manifests (a test fails while stale).
k8s-sync: install
	$(BIN)/python k8s/sync_serve_config.py

# The gRPC API's Python code (serve_app/front_door/grpc_api/generation_pb2*) from proto/glm4serve/v1/generation.proto.
proto: install
	$(BIN)/python -m tools.build_proto

clean:
	rm -rf $(VENV) $(SCAN_VENV) $(CLIENTS_VENV) .venv-lock $(TINY_MODEL)
