"""What a request is held to before its answer begins: the ``ingress`` section's settings and rules.

API keys (:mod:`.auth`), the body's bounds and strict validation (:mod:`.json_body`,
:mod:`.validation`, :mod:`.responses_rules`; large bodies in the checker process,
:mod:`.large_bodies`), what a request may cost (:mod:`.request_cost`, :mod:`.grammar_build`),
the key's limits (:mod:`.rate_limits`), the replica's places and fair share (:mod:`.capacity`),
time limits (:mod:`.deadlines`), each in a module of its own; :mod:`.pipeline` applies them in
order to one body. Nothing here calls the engine.

Runs in each model replica.
"""
