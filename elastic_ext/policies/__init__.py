"""Soft failures decided in the job: the numeric guard and its rollback skips, straggler decisions
and eviction (worker; at step and at commit).
"""
