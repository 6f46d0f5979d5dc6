"""The gRPC API: ``glm4serve.v1.Generation`` (proto/glm4serve/v1/generation.proto).

``generation_pb2*`` are generated (``make proto``); :mod:`.messages` converts
between its messages and the HTTP API's JSON; :mod:`.service` answers the calls
in the model replica.

Runs in each model replica, called by Serve's gRPC proxy.
"""
