"""The Responses API's stored responses and background answers, kept where every replica reads them.

:mod:`.store` is what a store keeps and the contract both stores meet; :mod:`.memory_store`
(one replica) and :mod:`.redis_store` (any number) keep it. :mod:`.history` turns a
``previous_response_id`` into input items, :mod:`.background` runs answers detached from their
connection and follows their event logs, and :mod:`.routes` is the HTTP surface over them.

Runs in each model replica (its front door).
"""
