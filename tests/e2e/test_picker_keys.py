"""The ReplicaPicker reads nothing of a request whose key the front door would refuse.

On ``glm-keyed`` (the bed with two API keys and prefix-aware routing, behind Serve's HAProxy as
shipped), HAProxy asks the picker about every POST and hands it the client's ``Authorization``
header (deploy/cluster.env). A request without an accepted key is routed by load, its body
unread: its prompt never reaches the router's table, so the router's decisions counter, which
counts each request whose prompt it read, grows only for the keyed request.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.routing.metrics import PREFIX_ROUTING_DECISIONS
from tests.e2e.harness.apps import LIGHT_KEY
from tests.e2e.harness.bodies import chat, grpc_chat
from tests.e2e.harness.grpc_calls import Multiplexed, channel, refused_as
from tests.e2e.harness.simulation import ready_bed
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, increase, scrape, settled
from tests.waiting import wait_until

pytestmark = pytest.mark.applications("glm-keyed")

DECISIONS = f"ray_{PREFIX_ROUTING_DECISIONS}_total"
REFUSED: tuple[dict[str, str], ...] = (
    {},
    {"Authorization": "Bearer sk-e2e-not-a-configured-key-0000"},
    {"Authorization": LIGHT_KEY},
)


async def test_a_request_without_an_accepted_key_leaves_no_prompt_in_the_router(variants, metrics_url):
    keyed = (await ready_bed(variants["glm-keyed"])).app
    before = await settled(metrics_url, DECISIONS)  # earlier tests' picks all reported
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as client:
        for n, headers in enumerate(REFUSED):
            body = chat(keyed.model, 4, content=f"A prompt the picker must not read, number {n}.")
            refused = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert refused.status_code == 401, refused.text
        body = chat(keyed.model, 4, content="The one prompt the picker reads.")
        answered = await client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {LIGHT_KEY}"}
        )
        assert answered.status_code == 200, answered.text

    def counted():
        samples = scrape(metrics_url)
        return samples if increase(before, samples, DECISIONS, application=keyed.name) >= 1 else None

    # The refused requests went to the picker first, in the same process: once the keyed one shows,
    # any of theirs would have too.
    after = await wait_until(
        lambda: asyncio.to_thread(counted), 60, f"{DECISIONS} of {keyed.name} grows", every_s=SCRAPE_EVERY_S
    )
    assert increase(before, after, DECISIONS, application=keyed.name) == 1


async def test_a_multiplexed_grpc_call_without_an_accepted_key_ends_unauthenticated_unread(variants):
    """A Stream call (many requests on one call) is let in by its key before any of its messages is
    read: without one it ends UNAUTHENTICATED with no response, its requests neither run nor get
    a final response each. (A client still writing as the server ends the call may read grpc's
    own lost-status INTERNAL instead: :data:`CLIENT_LOST_STATUS`.)"""
    keyed = (await ready_bed(variants["glm-keyed"])).app
    async with channel(keyed) as grpc_channel:
        call = Multiplexed(pb_grpc.GenerationStub(grpc_channel))
        for n in range(3):
            await call.send(pb.StreamRequest(id=f"r{n}", chat=grpc_chat(keyed.model, 4)))
        code, details = await call.close()
    assert refused_as(code, details, grpc.StatusCode.UNAUTHENTICATED), (code, details)
    assert call.responses == []
