"""Which model replica answers a request: prefix-aware routing, load first.

:mod:`.prefix_router` is Serve's request router for a model deployment whose config turns
prefix routing on; Serve builds it in each process that holds a handle to the deployment: the
ReplicaPicker's replicas (:mod:`serve_app.deployments.replica_picker`), and under a bare
``serve run``, Serve's proxy. :mod:`.prefix_table` is its rule (pure logic),
:mod:`.prompt_text` the prompt it keys on, :mod:`.metrics` what it decided.

Runs in each ReplicaPicker replica, and under a bare ``serve run`` also in Serve's proxy, which
holds a handle to the model deployment.
"""
