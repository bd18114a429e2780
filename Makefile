# `make demo` and `make test` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.baton-installed
# The pins (TORCH_CPU, TORCH_GPU, NIXL_CORE, NIXL_FRONT, TRITON_CPU), shared with the container image's install.
PINS := deploy/requirements/pins.env
include $(PINS)
DEMO_MODEL := models/demo-small
# lm-evaluation-harness and aiperf, run by tests/test_third_party_clients.py, in their own venv (clients.txt says why).
CLIENTS_VENV := .venv-clients
CLIENTS_REQS := deploy/requirements/clients.txt
CLIENTS_STAMP := $(CLIENTS_VENV)/.baton-installed
# npm packages of the Grafana dashboards type check (tests/test_grafana.py), pinned by package-lock.json.
GRAFANA := deploy/grafana
GRAFANA_STAMP := $(GRAFANA)/node_modules/.baton-installed
# Installs with patience for a flaky network (a CI run once lost its 79 MB ray wheel at 60 MB six times in a row):
# pip's own retries and resumed downloads, then up to two more whole attempts of any install command. The first
# pip call upgrades pip, whose older releases lack --resume-retries. Each prints its command alone.
PIP_OPTS := --retries 10 --resume-retries 20
retry = echo "$(1)"; n=0; until $(1); do n=$$((n + 1)); \
	if [ $$n -ge 3 ]; then echo "failed 3 times: $(1)" >&2; exit 1; fi; \
	echo "failed; attempt $$((n + 1)) of 3 in 20 s: $(1)" >&2; sleep 20; done
pip = $(call retry,$(BIN)/python -m pip install -q $(1))

.PHONY: venv clients-venv demo test lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile $(PINS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(call pip,--upgrade pip)
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(call pip,$(PIP_OPTS) '$(TORCH_GPU)'); \
	else \
		$(call pip,$(PIP_OPTS) $(TORCH_CPU)); \
	fi
	# Pin the torch just installed so that nothing below replaces it with another build.
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/constraints.txt
	@$(call pip,$(PIP_OPTS) -c $(VENV)/constraints.txt -e '.[dev]')
	# NIXL: the CUDA-13 build of the core library (it also runs on CPU through UCX) plus the thin `nixl`
	# front package without its dependency on every CUDA flavour (~460 MB).
	@$(call pip,$(PIP_OPTS) -c $(VENV)/constraints.txt $(NIXL_CORE))
	@$(call pip,$(PIP_OPTS) --no-deps $(NIXL_FRONT))
	# Triton: CUDA builds of torch bring their own; on CPU the kernels' tests run in Triton's interpreter.
	@$(BIN)/python -c "import triton" 2>/dev/null || { $(call pip,$(PIP_OPTS) --no-deps $(TRITON_CPU)); }
	touch $(STAMP)

clients-venv: $(CLIENTS_STAMP)

$(CLIENTS_STAMP): $(CLIENTS_REQS)
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	@$(call retry,$(CLIENTS_VENV)/bin/python -m pip install -q --upgrade pip)
	@$(call retry,$(CLIENTS_VENV)/bin/python -m pip install -q $(PIP_OPTS) -r $(CLIENTS_REQS))
	touch $(CLIENTS_STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(BIN)/baton make-model $(DEMO_MODEL) --preset small --seed 0

demo: $(STAMP) $(DEMO_MODEL)/config.json
	$(BIN)/baton demo --model $(DEMO_MODEL)

$(GRAFANA_STAMP): $(GRAFANA)/package.json $(GRAFANA)/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "npm not found: tests/test_grafana.py needs Node.js >= 18 and npm" >&2; exit 1; }
	@$(call retry,npm ci --prefix $(GRAFANA) --no-audit --no-fund)
	touch $(GRAFANA_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) $(GRAFANA_STAMP)
	$(BIN)/ruff check .
	# Tests of Triton kernels in the interpreter and the other pure CPU tests (no ports, no clocks: `pure_cpu`) go
	# first: two workers share them, one thread each (two each oversubscribe the cores), a worker that runs dry taking
	# tests queued for the other (a few take 30-50 s). Then the rest (servers, clusters and timeouts) on two workers
	# by module, so that a module's cluster is started once: those tests mostly wait on processes starting, which
	# leaves a core idle when they run one at a time; those whose routing depends on poll timing (`serial`) run
	# alone last. Each part lists its slowest tests: the suite's time on CI is a budget. The third-party clients'
	# environment, which only the second part uses, installs meanwhile (mostly downloads).
	$(MAKE) -s clients-venv > $(CLIENTS_VENV).log 2>&1 & clients=$$!; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow and (interpreter or pure_cpu)" --durations=15; \
	first=$$?; wait $$clients || { cat $(CLIENTS_VENV).log; exit 1; }; exit $$first
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not interpreter and not pure_cpu and not serial" \
	  --durations=30
	$(BIN)/python -m pytest -q -m "not slow and serial"

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) $(CLIENTS_VENV).log models .pytest_cache .ruff_cache $(GRAFANA)/node_modules
