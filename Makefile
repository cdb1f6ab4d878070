# The README's two commands. Each creates .venv when missing and installs the package with its dev extras,
# pinned by constraints.txt (torch==2.13.0 is the CPU build; an unpinned torch pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-scripts compat stress lint bench gpu clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/masked_lm.py

# The package's tests; the scripts' end-to-end runs (`script`: the benchmarks, the demo, the templates) are a lane of
# their own, which CI runs too.
test: $(STAMP)
	$(PY) -m pytest -q -m "not script"

# Each benchmark script with its --quick settings (it runs, exits 0, writes its JSON), the demo on a small corpus and
# the two templates on 2 CPU processes: about 4 minutes.
test-scripts: $(STAMP)
	$(PY) -m pytest -q -m script

# Development lane, about a minute: the in-process tests (the property tests, the window's, counts', modes', …, and
# doctests) and the forked gloo tests marked `core` (exactness in both front ends against the reference, the pinned
# costs). `make test` runs the rest: every other forked gloo case, and the real launches (`slow`).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "(core and not slow) or not (distributed or slow or script)"

# The full suite on the oldest and the newest torch pyproject.toml declares (.ci/compat): each in a venv cached under
# ~/.cache/token-mean/, built on first use (a CUDA build of torch from the package index, ~5 GB each), about 12 minutes
# a suite on 2 cores. `.ci/compat oldest -m "not slow"` for one end and pytest's arguments.
compat:
	.ci/compat

# Every test file that starts processes, 20 consecutive runs each (a test that fails one run in twenty is a defect):
# about three hours on 2 cores. `tests/stress.py --help` for fewer runs, some files, or without the real launches
# (`--fast`: leaves out `slow`).
stress: $(STAMP)
	$(PY) tests/stress.py --runs 20

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src
	$(VENV)/bin/mypy

# Every recorded figure (benchmarks/results/, quoted in both READMEs) at the current commit: about half an hour on 2 cores.
bench: $(STAMP)
	$(PY) benchmarks/cost.py
	$(PY) benchmarks/scale_model.py
	$(PY) benchmarks/slow_loader.py
	$(PY) benchmarks/fidelity.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/model_parallel.py
	$(PY) benchmarks/audit.py
	$(PY) benchmarks/count_check.py

# The GPU check (issue 44): the GPU lane (`pytest -m gpu tests/test_gpu.py`) and benchmarks/gpu_step.py, from the
# source tree with no .venv (GPU_PYTHON: an interpreter with a CUDA build of torch, lightning and pytest), ~5.5 min
# on one H200 -> benchmarks/results/gpu_step.{json,md}, logs in runs/gpu/ (and $$OUT where set). See the script.
GPU_PYTHON ?= python3
gpu:
	PYTHON=$(GPU_PYTHON) bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
