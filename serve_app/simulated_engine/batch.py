"""Continuous batching as vLLM's (v1) scheduler does it, with drawn tokens in place of a model.

Pure logic over a clock the caller passes in, so it is tested without vLLM or
time. Each step:

1. Running sequences, oldest first, get their next tokens within the step's token
   budget: one for a decoding sequence, a chunk of its prompt for one in prefill.
   When the KV cache cannot hold them, the youngest running sequence is preempted
   (its cache freed, back to the head of the queue, its context recomputed later),
   as vLLM does.
2. Waiting sequences join in arrival order while there is a free sequence slot
   (``max_num_seqs``), budget and KV cache (none join in a step that preempted).
   With vLLM's priority scheduling (``by_priority``) they wait in order of priority
   (lower first), then arrival, and the sequence preempted is the one of highest
   priority value, then the latest arrival, among those not yet scheduled in the step.
3. When the step ends, each sequence whose whole context is now computed gets one
   token. The stop rules are vLLM's (``check_stop``): the stop token, then
   ``max_tokens`` or the context limit; nothing stops before ``min_tokens``.

With a prefix cache (:mod:`serve_app.simulated_engine.prefix_cache`), a sequence
that joins starts with its cached prompt blocks computed, so only the rest is
prefilled, and the blocks it computes are cached as they are scheduled.

Token ids are drawn from the tokenizer's ordinary vocabulary and never equal a
request's stop tokens by chance; a request that may end early ends with its stop
token with probability ``stop_probability`` per token.

Runs in each model replica with a simulated engine.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from serve_app.simulated_engine.prefix_cache import PrefixCache
from serve_app.simulated_engine.timing import GpuTiming


class Finish(enum.Enum):
    STOP = "stop"  # the stop token
    LENGTH = "length"  # max_tokens, or the context is full


class Event(enum.Enum):
    """What vLLM's scheduler records for a request's queueing metrics."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass(eq=False)
class SimSequence:
    """One sequence (vLLM's engine sees each of ``n`` choices as its own request)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    max_model_len: int
    min_tokens: int
    stop_token: int | None  # the token it ends with when it ends early; None: it may not
    stop_reason: int | None  # reported with that stop: None for the EOS token, else the stop token id
    avoid: frozenset[int]  # never drawn by chance: the request's stop tokens in the vocabulary
    rng: random.Random
    arrival_s: float
    priority: int = 0  # vLLM's request priority: read with priority scheduling only
    logprobs: int | None = None  # alternatives to report per token (None: no logprobs); not read here
    block_hashes: tuple[int, ...] = ()  # the prompt's full KV blocks (with a prefix cache)
    cached_tokens: int = 0  # prompt tokens the prefix cache held when it first joined
    preemptions: int = 0
    cached_blocks: int = 0  # leading prompt blocks it has put in the prefix cache
    output_tokens: int = 0
    computed_tokens: int = 0  # context tokens whose KV the cache holds
    scheduled_tokens: int = 0  # tokens the current step computes for it
    done: bool = False  # finished or aborted
    events: list[tuple[Event, float]] = field(default_factory=list)  # not yet reported

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def decoding(self) -> bool:
        return self.output_tokens > 0 and self.computed_tokens == self.context_tokens - 1


@dataclass(frozen=True)
class Step:
    """One engine step: when it started, how long it takes and what it computes."""

    start_s: float
    duration_s: float
    sequences: list[SimSequence]

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class Emitted:
    """A token a sequence got at the end of a step."""

    sequence: SimSequence
    token: int
    finish: Finish | None
    stop_reason: int | None = None


class ContinuousBatch:
    """The running and waiting sequences of one simulated engine."""

    def __init__(
        self,
        timing: GpuTiming,
        max_num_seqs: int,
        vocabulary: Sequence[int],
        stop_probability: float = 0.0,
        prefix_cache: PrefixCache | None = None,
        by_priority: bool = False,
    ) -> None:
        if not vocabulary:
            raise ValueError("the vocabulary to draw tokens from is empty")
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.vocabulary = vocabulary
        self.stop_probability = stop_probability
        self.prefix_cache = prefix_cache
        self.by_priority = by_priority
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.kv_used_tokens = 0
        self._by_id: dict[str, SimSequence] = {}

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.timing.kv_capacity_tokens

    def add(self, sequence: SimSequence) -> None:
        if sequence.prompt_tokens + 1 > self.timing.kv_capacity_tokens:
            raise ValueError(
                f"a {sequence.prompt_tokens}-token prompt does not fit the KV cache "
                f"({self.timing.kv_capacity_tokens} tokens)"
            )
        if len(sequence.avoid) >= len(self.vocabulary):
            raise ValueError("the request's stop tokens leave no token to draw")
        sequence.events.append((Event.QUEUED, sequence.arrival_s))
        self._by_id[sequence.request_id] = sequence
        if self.by_priority:
            self._wait_in_priority_order(sequence)
        else:
            self.waiting.append(sequence)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop sequences (a client left, a stop string matched); their KV cache is freed at once."""
        for request_id in request_ids:
            sequence = self._by_id.pop(request_id, None)
            if sequence is None:
                continue
            sequence.done = True
            if sequence in self.running:
                self.running.remove(sequence)
                self.kv_used_tokens -= sequence.computed_tokens + sequence.scheduled_tokens
            else:
                self.waiting.remove(sequence)

    def schedule(self, start_s: float) -> Step | None:
        """The step starting at ``start_s``; None when nothing can run (sequences that arrive later wait)."""
        budget = self.timing.max_num_batched_tokens
        capacity = self.timing.kv_capacity_tokens
        scheduled: list[SimSequence] = []
        preempted = False
        prefill_tokens = 0
        index = 0
        while index < len(self.running) and budget > 0:
            sequence = self.running[index]
            tokens = min(sequence.context_tokens - sequence.computed_tokens, budget)
            while self.kv_used_tokens + tokens > capacity:
                victim = self._victim(index)
                self._preempt(victim, start_s)
                preempted = True
                if victim is sequence:
                    break
            if self.running[index : index + 1] != [sequence]:
                break  # it was the youngest, and was preempted
            if not sequence.decoding:
                prefill_tokens += tokens
            self._schedule(sequence, tokens, scheduled)
            budget -= tokens
            index += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            sequence = self.waiting[0]
            if sequence.arrival_s > start_s:
                break  # arrived while this step was being planned: the next one
            hit = self._cached_tokens(sequence)
            tokens = min(sequence.context_tokens - hit, budget)
            if self.kv_used_tokens + hit + tokens > capacity:
                break
            self.waiting.popleft()
            self.running.append(sequence)
            sequence.events.append((Event.SCHEDULED, start_s))
            if self.prefix_cache is not None:
                self._join_with_cached_prefix(sequence)
            prefill_tokens += tokens
            self._schedule(sequence, tokens, scheduled)
            budget -= tokens
        if not scheduled:
            return None
        context = sum(s.computed_tokens + s.scheduled_tokens for s in scheduled)
        return Step(start_s, self.timing.step_s(context, prefill_tokens), scheduled)

    def complete(self, step: Step) -> list[Emitted]:
        """End ``step``: the tokens its sequences got (none for a prompt chunk that is not the last)."""
        emitted = []
        for sequence in step.sequences:
            if sequence.done:  # aborted during the step
                continue
            sequence.computed_tokens += sequence.scheduled_tokens
            sequence.scheduled_tokens = 0
            if sequence.computed_tokens == sequence.context_tokens:
                emitted.append(self._next_token(sequence))
        return emitted

    def _cached_tokens(self, sequence: SimSequence) -> int:
        """Of a waiting sequence's prompt, the tokens the prefix cache would give it now."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.hit_tokens(sequence.block_hashes, sequence.prompt_tokens)

    def _join_with_cached_prefix(self, sequence: SimSequence) -> None:
        assert self.prefix_cache is not None
        hit = self.prefix_cache.admit(sequence.block_hashes, sequence.prompt_tokens, sequence.preemptions > 0)
        if not sequence.preemptions:
            sequence.cached_tokens = hit
        sequence.computed_tokens = hit
        sequence.cached_blocks = hit // self.prefix_cache.block_tokens
        self.kv_used_tokens += hit

    def _schedule(self, sequence: SimSequence, tokens: int, scheduled: list[SimSequence]) -> None:
        sequence.scheduled_tokens = tokens
        self.kv_used_tokens += tokens
        scheduled.append(sequence)
        if self.prefix_cache is not None:  # (as vLLM caches full blocks when it allocates them)
            full = min(sequence.computed_tokens + tokens, sequence.prompt_tokens) // self.prefix_cache.block_tokens
            if full > sequence.cached_blocks:
                self.prefix_cache.insert(sequence.block_hashes[sequence.cached_blocks : full])
                sequence.cached_blocks = full

    def _preempt(self, sequence: SimSequence, now_s: float) -> None:
        self.kv_used_tokens -= sequence.computed_tokens
        sequence.computed_tokens = 0
        sequence.cached_blocks = 0
        sequence.preemptions += 1
        sequence.events.append((Event.PREEMPTED, now_s))
        if self.by_priority:
            self._wait_in_priority_order(sequence)
        else:
            self.waiting.appendleft(sequence)

    def _victim(self, first: int) -> SimSequence:
        """Remove and return the running sequence to preempt, of those from ``first`` on: the
        youngest, or with priority scheduling the highest priority value, then the latest arrival."""
        if not self.by_priority:
            return self.running.pop()
        victim = max(self.running[first:], key=lambda s: (s.priority, s.arrival_s))
        self.running.remove(victim)
        return victim

    def _wait_in_priority_order(self, sequence: SimSequence) -> None:
        """Queue ``sequence`` behind every waiting one of lower or equal (priority, arrival)."""
        key = (sequence.priority, sequence.arrival_s)
        at = len(self.waiting)
        while at > 0 and (self.waiting[at - 1].priority, self.waiting[at - 1].arrival_s) > key:
            at -= 1
        self.waiting.insert(at, sequence)

    def _next_token(self, sequence: SimSequence) -> Emitted:
        finish: Finish | None = None
        stop_reason = None
        if (
            self.stop_probability
            and sequence.stop_token is not None
            and sequence.output_tokens >= sequence.min_tokens
            and sequence.rng.random() < self.stop_probability
        ):
            token, finish, stop_reason = sequence.stop_token, Finish.STOP, sequence.stop_reason
        else:
            token = self._draw(sequence)
        sequence.output_tokens += 1
        if finish is None and (
            sequence.output_tokens >= sequence.max_tokens or sequence.context_tokens >= sequence.max_model_len
        ):
            finish = Finish.LENGTH
        if finish is not None:
            sequence.done = True
            self._by_id.pop(sequence.request_id, None)
            self.running.remove(sequence)
            self.kv_used_tokens -= sequence.computed_tokens
        return Emitted(sequence, token, finish, stop_reason)

    def _draw(self, sequence: SimSequence) -> int:
        vocabulary, rng = self.vocabulary, sequence.rng
        token = vocabulary[rng.randrange(len(vocabulary))]
        while token in sequence.avoid:  # (a request's own stop tokens; the vocabulary has others)
            token = vocabulary[rng.randrange(len(vocabulary))]
        return token
