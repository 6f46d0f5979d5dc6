"""The HTTP door: the OpenAI-compatible API's routes over the front door's core.

Runs in each model replica, behind Serve's HAProxy.
"""
