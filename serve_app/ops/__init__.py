"""Commands run beside the application, never inside a Serve replica.

Runs in the pods' hooks, a Kubernetes Job and a shell, as each module says.

- :mod:`.model_download`: fetch the checkpoints a serve config serves (a Kubernetes Job, and
  each worker pod's init container).
- :mod:`.node_drain`: drain a Ray node before its pod goes (the worker pods' preStop hook).
- :mod:`.quantise_w4a16`: write a 4-bit weight-only copy of a checkpoint (offline).
"""
