# `make demo` and `make test` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.baton-installed
# CPU machines take the CPU wheel of torch that lies on disk; a machine with a GPU keeps its own torch.
TORCH_CPU := torch==2.13.0
DEMO_MODEL := models/demo-small
NIXL_CORE := nixl-cu13==1.5.1
NIXL_FRONT := nixl==1.5.1
TRITON_CPU := triton==3.9.0
# npm packages of the Grafana dashboards type check (tests/test_grafana.py), pinned by package-lock.json.
GRAFANA := deploy/grafana
GRAFANA_STAMP := $(GRAFANA)/node_modules/.baton-installed

.PHONY: venv demo test lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install -q 'torch>=2.9'; \
	else \
		$(BIN)/python -m pip install -q $(TORCH_CPU); \
	fi
	# Pin the torch just installed so that nothing below replaces it with another build.
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	# NIXL: the CUDA-13 build of the core library (it also runs on CPU through UCX) plus the thin `nixl`
	# front package without its dependency on every CUDA flavour (~460 MB).
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt $(NIXL_CORE)
	$(BIN)/python -m pip install -q --no-deps $(NIXL_FRONT)
	# Triton: CUDA builds of torch bring their own; on CPU the kernels' tests run in Triton's interpreter.
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q --no-deps $(TRITON_CPU)
	touch $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(BIN)/baton make-model $(DEMO_MODEL) --preset small --seed 0

demo: $(STAMP) $(DEMO_MODEL)/config.json
	$(BIN)/baton demo --model $(DEMO_MODEL)

$(GRAFANA_STAMP): $(GRAFANA)/package.json $(GRAFANA)/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "npm not found: tests/test_grafana.py needs Node.js >= 18 and npm" >&2; exit 1; }
	npm ci --prefix $(GRAFANA) --no-audit --no-fund
	touch $(GRAFANA_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) $(GRAFANA_STAMP)
	$(BIN)/ruff check .
	# Tests of Triton kernels in the interpreter are pure CPU work (no ports, no clocks): two workers share them, then
	# the rest run one at a time (servers, clusters and timeouts on a 2-core box).
	$(BIN)/python -m pytest -q -n 2 -m "not slow and interpreter"
	$(BIN)/python -m pytest -q -m "not slow and not interpreter"

clean:
	rm -rf $(VENV) models .pytest_cache .ruff_cache $(GRAFANA)/node_modules
