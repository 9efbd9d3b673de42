"""The worker while it trains: the ``run`` loop, liveness and the stall check, cutting Gloo's links
on a failure, ending a worker whose collective waits on links Gloo already closed, and the guardian
sidecar that watches the worker's heartbeat.
"""
