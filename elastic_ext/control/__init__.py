"""What the launcher's driver and its workers share: the store's scopes, keys and client, the Horovod seam's
check and record, and the preemption notices they pass each other. Nothing here starts a thread or changes
Horovod when imported."""
