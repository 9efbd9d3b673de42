"""Side-by-side benchmarks of elastic_ext against its peers: plain Horovod, torchrun, torch.save.

Each benchmark is a module run from the repository root, e.g.
``.venv/bin/python -m bench.commit``; it writes ``bench/results/<name>.json``
(and most a ``.png``) and prints a table. What they share is in
:mod:`bench.harness`; bench/README.md lists them.
"""
