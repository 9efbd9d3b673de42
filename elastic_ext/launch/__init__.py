"""The launcher's processes: ``elastic-horovodrun`` and Horovod's driver as it changes it, and ``supervise``.

Everything here runs in the driver's process (the command line, the driver's
subclass of Horovod's ``ElasticDriver``, the store's server side, the
discovery and worker runs, the build checks) or in ``supervise``'s. What a
worker runs is in :mod:`elastic_ext.worker`; what both sides share (the
store's keys and client, the Horovod seam's check and record, the notice
messages) in :mod:`elastic_ext.control`. Plain ``horovodrun`` with its build
checks cached (``plain_horovodrun``) is here for the tests.
"""
