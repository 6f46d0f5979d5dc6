"""Each API key's prompts cached apart: the ``cache_salt`` a request is given.

vLLM's prefix cache names a prompt's blocks by their tokens and, in the first block, by the
request's ``cache_salt``: requests with different salts share no cached block. Without one,
a client can learn whether another client's prompt is cached (its answer's ``cached_tokens``,
and its time to first token), a block at a time. With API keys configured (and
``ingress.prefix_cache_per_key``, the default), every request gets the salt of its key, with
any salt the client sent folded in (a client may keep its own users apart further): no request
can carry another key's salt, whatever it sends. The salt is no secret, since what makes it
unforgeable is that the key's id is always hashed in.

Runs in each model replica (both doors), and in each ReplicaPicker replica, whose prefix-aware
routing keys a request's prompt by the same salt.
"""

from __future__ import annotations

import base64
import hashlib

_PERSON = b"glm4-cache-salt"  # (blake2b's personalisation: these digests are of no other use)


def key_cache_salt(key_id: str, client_salt: str | None = None) -> str:
    """The ``cache_salt`` of a request of the key ``key_id`` that sent ``client_salt`` (or none).

    43 URL-safe base64 characters: within what vLLM accepts (128, none of ``@/\\``)."""
    material = key_id.encode() + b"\0" + (client_salt or "").encode()
    digest = hashlib.blake2b(material, digest_size=32, person=_PERSON).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
