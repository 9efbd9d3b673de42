"""What runs before the user's code or beside Horovod's driver: the launcher (``python -m
elastic_ext.launch.horovodrun``), the keeper that restarts a worker in place, the round watch,
the early start of newcomers, ``supervise`` for a whole job, and plain ``horovodrun`` with its
build checks cached (``plain_horovodrun``, for the tests). The only place that touches Horovod's
private modules; :mod:`~elastic_ext.launch.horovod_seam` lists and checks every attribute it replaces or reads.
"""
