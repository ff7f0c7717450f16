# hvd_dssync: `make demo` runs the main job, `make test` runs the tests; both set up what is missing.
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
export PATH := $(VENV)/bin:$(PATH)

.PHONY: setup demo test test-wide test-core docs stress horovod-process-set-tests bench bench-report bench-loopback bench-sparse \
	bench-parity bench-rack-cost bench-long-steps bench-sensing simulate docs-check clean distclean

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	$(PY) -m pytest tests

# The 16-rank jobs and the launcher pairs that `make test` leaves out for CI's time (tests/multirank.py).
test-wide: setup
	$(PY) -m pytest tests -m wide

test-core: setup
	$(PY) -m pytest tests -m "not multirank"

# The process sets' stress runs: 8 ranks, 20 runs under each launcher, plain then ordered (about 30 minutes).
stress: setup
	cd tests && $(PY) stress_sets.py --runs 20 && $(PY) stress_sets.py --runs 20 --ordered

# Horovod's own process-set tests on the installed build; HOROVOD_SOURCE: a checkout of Horovod v0.28.1.
horovod-process-set-tests: setup
	bash tests/horovod_process_set_tests.sh "$(HOROVOD_SOURCE)"

bench: setup
	$(PY) -m hvd_dssync bench --steps 400 --max-train-seconds 45 --out bench-results

# Rebuild bench-results/results.md (the tables and the targets) from an existing bench-results/results.json.
bench-report:
	$(PY) -m hvd_dssync bench --report-only --out bench-results

# The experiments behind the docs' other figures (hvd_dssync/bench/experiments/), each as the docs quote it.
bench-loopback: setup
	$(PY) -m hvd_dssync.bench.experiments.loopback_bench --np 4 --params 1

bench-sparse: setup
	$(PY) -m hvd_dssync.bench.experiments.sparse_bench --ranks 4 --racks 2

# One rack's average through Horovod process sets (the build's concurrent sets on and off) and torch.distributed.
bench-rack-cost: setup
	$(PY) -m hvd_dssync.bench.experiments.rack_average_cost --ranks 8 --racks 2

# The default's sensing on the bench's networks and on 16 hosts, 10 fresh jobs each: how often it finds the right
# racks, its margins and its seconds (about 40 minutes).
bench-sensing: setup
	$(PY) -m hvd_dssync.bench.experiments.sensing_rate --runs 10 --networks static,bandwidth,none,sixteen

# mpirun, 2 hosts of 4 and 4 hosts of 2, 5 runs each: the longest step against the median averaging step.
bench-long-steps: setup
	$(PY) -m hvd_dssync.bench.experiments.long_steps --launcher mpirun --layouts 2x4,4x2 --runs 5

# Accuracy of the defaults' candidate periods and PyTorch's averagers against Horovod's at a fixed epoch budget,
# 4 tasks, 10 seeds, each configuration's difference from Horovod paired seed by seed with its bootstrap interval
# (about 12 minutes; every configuration of parity.py: --configs, about 50).
PARITY_CONFIGS := horovod,dssync-default,dssync-default-overlap,dssync-default-quickened,dssync-default-fragments,dssync-every-2,dssync-every-4,dssync-every-8,dssync-racks-8-global-32,dssync-one-group-every-8,dssync-one-group-every-16,postlocal-hierarchical-p8,postlocal-hierarchical-p16
bench-parity: setup
	mkdir -p bench-results && PATH=$(CURDIR)/.venv/bin:$$PATH PYTHONPATH=$(CURDIR) OMP_NUM_THREADS=1 HOROVOD_GLOO_IFACE=lo timeout -k 10 4800 \
	    horovodrun -np 4 -H localhost:4 --gloo python -m hvd_dssync.bench.experiments.parity --seeds 0,1,2,3,4,5,6,7,8,9 \
	    --configs $(PARITY_CONFIGS) --json bench-results/parity.json

simulate: setup
	$(PY) -m hvd_dssync simulate --workers 8,64,512,4096

docs-check: setup
	$(PY) -m pytest tests/test_docs.py

# The HTML docs: the Markdown pages and the API reference generated from the docstrings, warnings as errors.
docs: setup
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

# Build artefacts, bench results and caches; the virtual environment (with its patched Horovod) stays.
clean:
	rm -rf build *.egg-info .pytest_cache .hypothesis bench-results docs/_build
	find . -path ./.venv -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Everything clean removes, and the virtual environment: the next `make` rebuilds it (Horovod's build
# comes from the wheel cached in ~/.cache/hvd_dssync/ when there is one).
distclean: clean
	rm -rf $(VENV)
