"""What runs before the user's code or beside Horovod's driver: the launcher (``python -m
elastic_ext.launch.horovodrun``), the keeper that restarts a worker in place, the round watch,
the early start of newcomers, and ``supervise`` for a whole job. The only place that touches
Horovod's private modules.
"""
