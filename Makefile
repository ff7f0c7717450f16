# hvd_dssync: `make demo` runs the main job, `make test` runs the tests; both set up what is missing.
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.setup-done
export PATH := $(VENV)/bin:$(PATH)

.PHONY: setup demo test test-core bench bench-loopback bench-sparse simulate docs-check clean

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	$(PY) -m pytest tests

test-core: setup
	$(PY) -m pytest tests -m "not multirank"

bench: setup
	$(PY) -m hvd_dssync bench --steps 400 --max-train-seconds 45

bench-loopback: setup
	$(PY) scripts/loopback_bench.py --np 4 --params 1

bench-sparse: setup
	$(PY) scripts/sparse_bench.py --ranks 4 --racks 2

simulate: setup
	$(PY) -m hvd_dssync simulate --workers 8,64,512,4096

docs-check: setup
	$(PY) -m pytest tests/test_docs.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
