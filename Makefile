# Entry points. `make demo` and `make test` set up everything they need first
# (tools/setup.sh is idempotent: seconds when nothing is missing).
PY := .venv/bin/python

.PHONY: setup demo test test-unit test-multiprocess bench bench-all clean

setup:
	bash tools/setup.sh

demo: setup
	$(PY) examples/run_demo.py

test: setup
	$(PY) -m pytest tests -q -p no:cacheprovider

test-unit: setup
	$(PY) -m pytest tests/unit -q -p no:cacheprovider

test-multiprocess: setup
	$(PY) -m pytest tests/multiprocess -q -p no:cacheprovider

# The side-by-side comparison (plain Horovod, torchrun, elastic_ext): about 8 minutes.
bench: setup
	$(PY) -m bench.compare

# Every benchmark but the soak (compare, commit, checkpoint, recovery with 10
# failures per system, soft_failures): about 30 minutes on 2 cores.
bench-all: setup
	$(PY) -m bench.run_all

clean:
	rm -rf .venv .pytest_cache .hypothesis
