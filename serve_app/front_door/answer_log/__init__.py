"""The answer log: stored responses and the event logs of answers generated detached, kept where
every replica reads them. It knows neither the engine nor gRPC.

:mod:`.store` is what a store keeps and the contract both stores meet; :mod:`.memory_store`
(one replica) and :mod:`.redis_store` (any number; its client :mod:`.redis_client`) keep it;
:mod:`.patient` is the view running answers and their followers call, which waits out an outage;
:mod:`.follow` reads a log as it grows; :mod:`.history` turns a ``previous_response_id`` into
input items.

Runs in each model replica (its front door).
"""
