"""The worker while it trains: the ``run`` loop, liveness and the stall check, cutting Gloo's links
on a failure, and the guardian sidecar that watches the worker's heartbeat.
"""
