# Quickstart: `make demo` and `make test`. Both set up a local .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CORE   := $(VENV)/.flarepp-core
STAMP  := $(VENV)/.flarepp-test
TORCH_CPU := torch==2.13.0
# Every extra the suite tests (each claimed feature is tested, not skipped).
TEST_EXTRAS := test,mesh,surface,mesh-io,cluster,export,track,search,interop,serve

.PHONY: setup setup-core browser demo test test-fast gpu-check clean

setup: $(STAMP)
setup-core: $(CORE)

# Re-run only when the package metadata changes; an editable install picks up source edits.
# The core (what `make demo` imports): the CPU build of PyTorch and flarepp without extras.
$(CORE): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet $(TORCH_CPU)
	$(PIP) install --quiet -e .
	@touch $(CORE)

# The suite's environment: the core and every extra its tests need.
$(STAMP): $(CORE)
	$(PIP) install --quiet -e ".[$(TEST_EXTRAS)]"
	@touch $(STAMP)

demo: setup-core
	$(PY) -m flarepp demo

# Debian's Chromium for the serve page's browser test (tests/test_serve.py), where apt-get
# runs as root; elsewhere the test skips, saying so.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
	  || echo "no chromium: the serve page's browser test will skip"

# The whole CPU suite (about 8 minutes on 2 cores).
test: setup browser
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not cuda"

# The fast tier: no training runs, no extra processes, nothing over ~1 s (about 1 minute).
test-fast: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not cuda and not slow"

# Everything that needs CUDA, on one GPU, in at most 8 minutes (scripts/gpu_check.sh).
# An environment that already imports flarepp and pytest is used as it is (no pip: a GPU
# machine is often offline); otherwise `setup` runs first.
gpu-check:
	@$(PY) -c "import flarepp, pytest" 2>/dev/null || $(MAKE) setup
	PY=$(PY) scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs data .pytest_cache
