"""PrefixAffinityRouter: Serve's request router for a model deployment, by prompt prefix, load first.

A serve config turns it on per model (``prefix_routing`` in :mod:`serve_app.config`,
which sets the deployment's ``request_router_config``). Serve then builds one in every
process that holds a handle to the deployment (the ReplicaPicker's replicas, and under a
bare ``serve run`` without HAProxy, Serve's proxy) and asks it for each call. It reuses
Serve's power-of-two-choices router for everything but the
preference: when :func:`~serve_app.routing.prefix_table.choose` names a replica, that
replica is tried first and Serve's two random candidates after it (so a full preferred
replica never holds a request back); otherwise only the two candidates, as Serve's
default router would, the less busy first (direct streaming's picker takes the first as
it is). Loads are Serve's own queue-length cache, probed where stale.

Ray's ``PrefixCacheAffinityRouter`` was not used: it keys on the raw message text
(not the rendered template and tools), blocks the event loop on a remote prefix-tree
actor for every request, and cannot read this app's pickled large requests
(docs/architecture.md, decision record 11).

Runs in each ReplicaPicker replica (and, under a bare ``serve run``, in Serve's proxy).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from serve_app.glm4.format import CHAT_TEMPLATE_PATH
from serve_app.routing.metrics import PrefixRoutingMetrics
from serve_app.routing.prefix_table import (
    Choice,
    Decision,
    PrefixTable,
    RoutingKey,
    RunningPrompts,
    choose,
    opening_digest,
    prefix_blocks,
)
from serve_app.routing.prompt_text import PromptRenderer
from serve_app.serve_internals import (
    PICKED_REPLICA,
    DeploymentID,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    PowerOfTwoChoicesRequestRouter,
    ReplicaID,
    RequestRouter,
    RunningReplica,
    own_replica_id,
)

logger = logging.getLogger("ray.serve")

ROUTED_METHODS = frozenset({"chat", "completion"})  # the model replica's generation methods
REMEMBERED_REQUESTS = 4096  # keys of requests being routed, kept between their routing attempts
RUNNING_REQUESTS = 65_536  # requests followed until they end (ends Serve never reports drop out)
CHOSEN_NOT_SENT_S = 1.0  # longest a choice counts as load before Serve's own count has it
PICK_DELIVERY_S = 0.1  # direct streaming: longest a pick counts as load (HAProxy sends it on in milliseconds)
LOAD_REFRESH_S = 0.25  # a replica's load older than this is probed again, in the background
PROBE_ATTEMPTS = 3  # queue-length probes of a replica that has not answered, each with a longer deadline


def template_text(chat_template: str | None) -> str:
    """The chat template a model's replicas render with: GLM-4's, or the configured file or text."""
    if chat_template is None:
        return CHAT_TEMPLATE_PATH.read_text()
    path = Path(chat_template)
    return path.read_text() if "{" not in chat_template and path.is_file() else chat_template


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Prefers the replica that holds a request's prompt prefix, unless it is much busier."""

    def initialize_state(
        self,
        model: str = "",
        chat_template: str | None = None,
        block_chars: int = 64,
        max_blocks: int = 200_000,
        max_load_gap: int = 16,
        **_: Any,
    ) -> None:
        self._renderer = PromptRenderer(template_text(chat_template))
        self._block_chars = block_chars
        self._max_load_gap = max_load_gap
        self._table = PrefixTable(max_blocks)
        self._running = RunningPrompts(RUNNING_REQUESTS)
        self._probes: dict[ReplicaID, asyncio.Future[None]] = {}  # the probe under way for each replica
        self._probed_at: dict[str, float] = {}  # when the last probe each replica answered was sent
        # Per request being routed (by Serve's internal id): its key, what was chosen, and until
        # when the choice counts as its replica's load (Serve's own count does not have it yet).
        self._routing: OrderedDict[str, tuple[RoutingKey, Choice | None, float]] = OrderedDict()
        # Direct streaming's picks, oldest first: replica, prompt (RoutingKey.whole), counted until.
        self._recent_picks: deque[tuple[str, bytes, float]] = deque()
        # Requests whose end Serve reported before their routing (a short one may end first).
        self._ended_unrouted: OrderedDict[str, None] = OrderedDict()
        self._metrics = PrefixRoutingMetrics(model)
        self._own_replica = _own_replica(self._deployment_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_load: list[list[RunningReplica]] = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,  # Serve's own procedure: it reads only what this router has too (as Ray's own prefix router does)
            candidate_replicas=candidate_replicas,
            pending_request=pending_request,
        )
        if self._own_replica is not None:
            # A model replica calls its own deployment to pass on requests: never to itself;
            # with no other, wait for one.
            candidate_replicas = [r for r in candidate_replicas if r.replica_id != self._own_replica]
            by_load = [
                rank for rank in ([r for r in rank if r.replica_id != self._own_replica] for rank in by_load) if rank
            ]
        picked = pending_request.kwargs.get(PICKED_REPLICA) if pending_request is not None else None
        if picked is not None:  # the ReplicaPicker chose (a bare `serve run`): that one, else by load
            chosen = next((r for r in candidate_replicas if r.replica_id.to_full_id_str() == picked), None)
            return [[chosen], *by_load] if chosen is not None else by_load
        if pending_request is None or not by_load:
            return by_load
        key = self._key(pending_request)
        if key is None:
            return by_load
        request_id = pending_request.metadata.internal_request_id
        loads = await self._loads(candidate_replicas)
        running_same_prompt = self._running.replicas(key.whole, loads)
        self._count_choices_not_yet_sent(request_id, key, loads, running_same_prompt)
        choice = choose(key, self._table, loads, self._max_load_gap, running_same_prompt)
        self._routing[request_id] = (key, choice, time.monotonic() + CHOSEN_NOT_SENT_S)
        preferred = self._by_unique_id(choice.replica)
        if preferred is None:
            # Least loaded first: Serve compares a rank's loads itself when it dispatches, but the
            # ReplicaPicker (direct streaming) takes the first replica of the first rank as it is.
            unknown = max(loads.values(), default=0) + 1
            return [sorted(rank, key=lambda r: loads.get(r.replica_id.unique_id, unknown)) for rank in by_load]
        return [[preferred], *by_load]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key, choice, _ = self._routing.pop(pending_request.metadata.internal_request_id, (None, None, 0.0))
        if key is None:
            return
        self._table.record(key.blocks, replica_id.unique_id)
        request_id = pending_request.metadata.internal_request_id
        if request_id in self._ended_unrouted:
            del self._ended_unrouted[request_id]
        else:
            self._running.started(request_id, replica_id.unique_id, key.whole)
        self._metrics.routed(_decision(choice, replica_id).value, len(self._table))

    def on_replica_picked(self, internal_request_id: str, replica_id: ReplicaID) -> None:
        """Direct streaming: the ReplicaPicker named ``replica_id`` and HAProxy sends the request there.

        Serve dispatches nothing here, so neither :meth:`on_request_routed` nor
        :meth:`on_request_completed` follows. The table learns the prompt, as for a routed
        request; the pick counts as the replica's load for ``PICK_DELIVERY_S`` (this router's
        queue-length cache never sees the request sent), and no longer: no end is ever reported,
        and a pick counted for long would count requests long finished (a replica serving many
        short requests would look many times busier than it is, and lose its conversations). No
        running prompt is recorded, for the same reason.
        """
        entry = self._routing.pop(internal_request_id, None)
        if entry is None:  # routed by load: no prompt read
            return
        key, choice, _ = entry
        self._table.record(key.blocks, replica_id.unique_id)
        self._recent_picks.append((replica_id.unique_id, key.whole, time.monotonic() + PICK_DELIVERY_S))
        self._metrics.routed(_decision(choice, replica_id).value, len(self._table))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if internal_request_id in self._routing:
            self._ended_unrouted[internal_request_id] = None
            while len(self._ended_unrouted) > REMEMBERED_REQUESTS:
                self._ended_unrouted.popitem(last=False)
        else:
            self._running.ended(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        for gone in before - self._replica_id_set:
            self._forget(gone.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _forget(self, replica: str) -> None:
        self._probes = {id_: probe for id_, probe in self._probes.items() if id_.unique_id != replica}
        self._probed_at.pop(replica, None)
        self._table.forget(replica)
        self._running.forget(replica)

    def _key(self, pending_request: PendingRequest) -> RoutingKey | None:
        """The request's routing key, made once per request (routing may take several attempts)."""
        request_id = pending_request.metadata.internal_request_id
        if request_id in self._routing:
            return self._routing[request_id][0]
        if pending_request.metadata.call_method not in ROUTED_METHODS or not pending_request.args:
            return None
        try:
            prompt = self._renderer.render(pending_request.args[0])
        except Exception:  # a template error is the replica's to report (400); route by load
            logger.debug("prefix routing: the prompt did not render", exc_info=True)
            prompt = None
        if prompt is None:
            return None
        # Keyed as the engine's cache is: a prompt under another salt (another API key's) holds nothing there.
        salt = getattr(pending_request.args[0], "cache_salt", None)
        salt = salt if isinstance(salt, str) else None  # (a body's own, unvalidated: the replica's 400)
        key = RoutingKey(
            blocks=prefix_blocks(prompt.text, self._block_chars, salt),
            home=opening_digest(prompt.opening, salt),
            opening_blocks=len(prompt.opening) // self._block_chars,
            whole=opening_digest(prompt.text, salt),
        )
        self._routing[request_id] = (key, None, time.monotonic() + CHOSEN_NOT_SENT_S)
        while len(self._routing) > REMEMBERED_REQUESTS:  # requests cancelled while waiting
            self._routing.popitem(last=False)
        return key

    def _count_choices_not_yet_sent(
        self, request_id: str, key: RoutingKey, loads: dict[str, int], running_same_prompt: set[str]
    ) -> None:
        """Add the replicas chosen for other requests that Serve's loads do not count yet (for
        ``CHOSEN_NOT_SENT_S``, or a direct pick ``PICK_DELIVERY_S``): requests that arrive
        together must see each other."""
        now = time.monotonic()
        for other_id, (other_key, choice, counted_until) in self._routing.items():
            if other_id == request_id or choice is None or choice.replica not in loads or counted_until < now:
                continue
            loads[choice.replica] += 1
            if other_key.whole == key.whole:
                running_same_prompt.add(choice.replica)
        while self._recent_picks and self._recent_picks[0][2] < now:
            self._recent_picks.popleft()
        for replica, whole, _ in self._recent_picks:
            if replica in loads:
                loads[replica] += 1
                if whole == key.whole:
                    running_same_prompt.add(replica)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests each replica runs, from Serve's queue-length cache; replicas not in it are probed.

        A replica with no load in the cache (it keeps an answer 10 s) is waited for; one whose
        load is older than ``LOAD_REFRESH_S`` is probed again in the background, this request
        going by the load known. One probe per replica at a time: requests that arrive together
        share the probe under way of each replica they need, and never wait on another
        replica's probe alone (a replica left unprobed could not be preferred).
        """
        now = time.monotonic()
        missing = [r for r in replicas if self._replica_queue_len_cache.get(r.replica_id) is None]
        aging = [r for r in replicas if now - self._probed_at.get(r.replica_id.unique_id, 0.0) > LOAD_REFRESH_S]
        unprobed = [
            r
            for r in {r.replica_id: r for r in missing + aging}.values()
            if r.replica_id not in self._probes or self._probes[r.replica_id].done()
        ]
        if unprobed:
            probe = asyncio.ensure_future(self._probe_until_answered(unprobed))
            for replica in unprobed:
                self._probes[replica.replica_id] = probe
        if missing:
            probes = {self._probes[r.replica_id] for r in missing}
            outcomes = await asyncio.gather(*(asyncio.shield(p) for p in probes), return_exceptions=True)
            for outcome in outcomes:  # no loads to prefer by: load's own choice still follows
                if isinstance(outcome, Exception):
                    logger.debug("prefix routing: probing queue lengths failed", exc_info=outcome)
        loads: dict[str, int] = {}
        for replica in replicas:
            queue_len = self._replica_queue_len_cache.get(replica.replica_id)
            if queue_len is not None:  # no answer in time: not a candidate to prefer
                loads[replica.replica_id.unique_id] = queue_len
        return loads

    async def _probe_until_answered(self, replicas: list[RunningReplica]) -> None:
        """Probe with Serve's own growing deadlines (0.1, 0.2, 0.4 s by default) until each answers.

        A replica busy streaming can miss the first 0.1 s deadline; left out of the loads it
        could not be preferred, and a conversation's next turn would lose its cached history.
        Serve's probe puts each answer in the queue-length cache.
        """
        for backoff_index in range(PROBE_ATTEMPTS):
            sent_at = time.monotonic()
            answers = await self._probe_queue_lens(replicas, backoff_index)
            for replica, queue_len in answers:
                if queue_len is not None:
                    self._probed_at[replica.replica_id.unique_id] = sent_at
            replicas = [replica for replica, queue_len in answers if queue_len is None]
            if not replicas:
                return

    def _by_unique_id(self, unique_id: str | None) -> RunningReplica | None:
        if unique_id is None:
            return None
        return next((r for r in self._replicas_list if r.replica_id.unique_id == unique_id), None)


def _own_replica(deployment_id: DeploymentID) -> ReplicaID | None:
    """This process's replica, when it is one of the routed deployment's replicas."""
    replica_id = own_replica_id()
    if replica_id is None or replica_id.deployment_id != deployment_id:
        return None
    return replica_id


def _decision(choice: Choice | None, replica_id: ReplicaID) -> Decision:
    """How the replica a request went to was chosen, for the decisions metric."""
    if choice is None:
        return Decision.BY_LOAD
    if choice.replica not in (None, replica_id.unique_id):
        return Decision.FALLBACK  # the preferred replica refused it (full) or left
    return choice.decision
