"""Side-by-side benchmarks of elastic_ext against Horovod's own elastic API.

Each benchmark is a module run from the repository root, e.g.
``.venv/bin/python -m bench.commit``; it writes ``bench/results/<name>.json``
and ``bench/results/<name>.png`` and prints a table.
"""
