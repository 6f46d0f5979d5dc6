"""GLM-4-9B-Chat served by Ray Serve: :func:`serve_app.app.build_app` and what its processes run.

Runs in every process of the application: each folder runs in one kind of process
(docs/architecture.md's first table), and each module's docstring says which.
"""
