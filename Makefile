# The course's commands. Each sets itself up on a fresh machine: a .venv from requirements.txt.
#   make                 build the whole course: every lecture's page, and the index
#   make test            run the whole test suite
#   make test-torchrun   only the torchrun tests: every lecture on 4 ranks (compared with the
#                        notebooks, so they run too), two agents as two nodes
#   make lecture L=lecture_02_communication   build one lecture
#   make notebooks       execute the companion notebooks into content/notebooks/ (full sizes)
#   make jupyter         open the notebooks in JupyterLab with the course's kernel
#   make bench           side-by-side timings (pooled vs naive launch, ours vs PyTorch's, build times)
# Knobs: QUICK=1 (small sizes), LAUNCHER=pool|spawn, WORLD_SIZE=N, TIMEOUT=S, BACKEND=gloo|nccl,
#        VERBOSE=1 (also print the tracebacks of demos that fail as expected).

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
LECTURES := $(shell $(PYTHON) -c 'import lectures; print(*lectures.LECTURES)')
# QUICK=0 (or no, false, off) means off, as it reads
on = $(filter-out 0 no false off,$(1))
RUNFLAGS := $(if $(call on,$(QUICK)),--quick) $(if $(LAUNCHER),--launcher $(LAUNCHER)) \
            $(if $(WORLD_SIZE),--world-size $(WORLD_SIZE)) $(if $(TIMEOUT),--timeout $(TIMEOUT)) \
            $(if $(BACKEND),--backend $(BACKEND)) $(if $(call on,$(VERBOSE)),--verbose)
NBFLAGS  := $(if $(WORLD_SIZE),--world-size $(WORLD_SIZE)) $(if $(BACKEND),--backend $(BACKEND))
export PYTHONUNBUFFERED := 1
export MPLBACKEND := Agg

.PHONY: all content lecture test test-torchrun notebooks jupyter bench clean venv

# `make` runs every demo once, at full size, for the pages. The notebooks call the same section
# functions, so executing them too would pay for every demo twice: they are for changing knobs
# and re-running (`make jupyter`), `make test` executes each one (quick) and checks what it
# computed, and `make notebooks` renders them into content/notebooks/ when you want copies.
all: content
	@echo "open content/index.html in a browser"

venv: $(STAMP)
$(STAMP): requirements.txt
	@echo "setting up $(VENV) from requirements.txt (first time: a few minutes)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet -r requirements.txt
	@touch $@

content: $(STAMP)
	@failed=""; for l in $(LECTURES); do \
	  $(PY) -m util.run $$l $(RUNFLAGS) || failed="$$failed $$l"; \
	done; \
	if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

lecture: $(STAMP)
	@test -n "$(L)" || { echo "usage: make lecture L=lecture_02_communication"; exit 2; }
	@$(PY) -m util.run $(L) $(RUNFLAGS)

# The tests marked `timed` run last, after both course builds, on a machine no build shares.
test: $(STAMP)
	@$(PY) -m pytest tests --durations=25

test-torchrun: $(STAMP)
	@$(PY) -m pytest tests -m torchrun

notebooks: $(STAMP)
	@$(PY) -m util.build_notebooks $(if $(call on,$(QUICK)),--quick) $(NBFLAGS)

jupyter: $(STAMP)
	@$(PY) -c "from util.build_notebooks import register_kernel; register_kernel()"
	@echo "opening JupyterLab on lectures/notebooks/ (kernel: 'Python (course .venv)'); Ctrl-C to stop"
	@$(VENV)/bin/jupyter lab --notebook-dir=lectures/notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

bench: $(STAMP)
	@$(PY) -m scripts.bench

clean:
	@find content -mindepth 1 ! -name README.md -exec rm -rf {} +
