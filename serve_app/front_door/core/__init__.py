"""The front door's core: what every door calls to admit a request and generate its answer.

Runs in each model replica.
"""
