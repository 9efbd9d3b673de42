"""Committed state: the State, its tracked objects and adapters, snapshots and buffers, the sync of
joining workers and the commit's one collective (worker; at commit, restore and reset).
"""
