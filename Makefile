# Entry points. `make demo` and `make test` set up everything they need first
# (tools/setup.sh is idempotent: seconds when nothing is missing).
PY := .venv/bin/python

.PHONY: setup demo test test-unit test-multiprocess bench clean

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

bench: setup
	$(PY) -m bench.run_all

clean:
	rm -rf .venv .pytest_cache .hypothesis
