"""The simulated engine core: what vLLM's ``AsyncLLM`` talks to in place of its engine-core process.

``AsyncLLM`` turns requests into ``EngineCoreRequest`` s (tokenized prompt,
sampling parameters, ``n`` split into one request per choice) and hands them to
an engine-core client, then reads ``EngineCoreOutputs`` from it step by step and
turns them into text (detokenizer, stop strings, usage, metrics). This class is
that client, in the replica's own event loop: one ``asyncio.sleep`` per engine
step, whatever the number of sequences, and no thread.

Steps run back to back on the simulated clock while there is work, so a slow
event loop delays when outputs are read, as a busy API server does, but not
what the GPU would have produced by then. Tests drive it through
:meth:`SimulatedEngineCore.control` (:mod:`serve_app.simulated_engine.controls`):
pause, pace, death and hang.

vLLM's types are imported here, once, not per step or per token: this module is
loaded only where an engine runs (a model replica, a benchmark), never by the application's build or the picker.

Runs in each model replica with a simulated engine, on the replica's event loop.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from vllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
)
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.stats import PrefillStats, PrefixCacheStats, SchedulerStats
from vllm.v1.outputs import LogprobsLists

from serve_app import vllm_internals
from serve_app.config import SimulatedEngineConfig
from serve_app.simulated_engine.batch import ContinuousBatch, Emitted, Finish, SimSequence
from serve_app.simulated_engine.controls import HEARTBEAT_S, Control, EngineState, Switches
from serve_app.simulated_engine.prefix_cache import PrefixCache, block_hashes
from serve_app.simulated_engine.timing import GpuTiming

# Alternatives reported per token when a request asks logprobs (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


@dataclass
class _Resources:
    engine_dead: bool = False  # (read by AsyncLLM.errored)


class SimulatedEngineCore:
    """The part of vLLM's engine-core client interface ``AsyncLLM`` uses to generate."""

    def __init__(self, vllm_config: Any, tokenizer: Any, config: SimulatedEngineConfig) -> None:
        timing = GpuTiming.from_config(config)
        max_model_len = vllm_config.model_config.max_model_len
        if timing.kv_capacity_tokens < max_model_len:
            raise ValueError(
                f"the simulated KV cache ({timing.kv_capacity_tokens} tokens) cannot hold one "
                f"max_model_len ({max_model_len}) sequence"
            )
        special = set(tokenizer.all_special_ids)
        vocabulary = [token for token in range(tokenizer.vocab_size) if token not in special]
        self.prefix_cache: PrefixCache | None = None
        if vllm_config.cache_config.enable_prefix_caching:
            blocks = timing.kv_capacity_tokens // config.kv_block_tokens
            self.prefix_cache = PrefixCache(config.kv_block_tokens, blocks)
        self.batch = ContinuousBatch(
            timing,
            vllm_config.scheduler_config.max_num_seqs,
            vocabulary,
            config.stop_probability,
            self.prefix_cache,
            by_priority=vllm_config.scheduler_config.policy == "priority",
        )
        self.max_model_len = max_model_len
        self.engine_ranks_managed = [0]
        self.resources = _Resources()
        self._vocabulary = frozenset(vocabulary)
        self._seeds = random.Random(config.seed)
        self._work = asyncio.Event()  # a request arrived or a control changed
        self._controlled = asyncio.Event()  # a control changed
        self._clock_s = 0.0
        self.switches = Switches()
        self._next_heartbeat_s = 0.0
        self.steps = self.tokens = 0
        self.busy_s = 0.0
        # What vLLM's engine core reports at start (read by vLLM's metrics and logs).
        cache = vllm_config.cache_config
        cache.block_size = config.kv_block_tokens
        cache.num_gpu_blocks = timing.kv_capacity_tokens // cache.block_size
        cache.kv_cache_size_tokens = timing.kv_capacity_tokens

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def add_request_async(self, request: Any) -> None:
        """Queue one ``EngineCoreRequest`` (one choice of a request)."""
        if self.resources.engine_dead:
            raise EngineDeadError()  # as vLLM's client refuses input for a dead engine core
        params = request.sampling_params
        if params is None:
            raise ValueError("the simulated engine only generates text")
        if params.prompt_logprobs is not None:
            raise ValueError("the simulated engine does not compute prompt_logprobs")
        prompt_ids = request.prompt_token_ids or ()
        prompt_tokens = len(prompt_ids)
        stop_ids = list(params.stop_token_ids or ())
        if params.eos_token_id is not None:  # (None with ignore_eos)
            stop_token, stop_reason = params.eos_token_id, None
        elif stop_ids:
            stop_token, stop_reason = stop_ids[0], stop_ids[0]
        else:
            stop_token = stop_reason = None
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_tokens
        self.batch.add(
            SimSequence(
                request_id=request.request_id,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                max_model_len=self.max_model_len,
                min_tokens=params.min_tokens,
                stop_token=stop_token,
                stop_reason=stop_reason,
                avoid=frozenset(params.all_stop_token_ids | set(stop_ids)) & self._vocabulary,
                rng=random.Random(seed),
                arrival_s=asyncio.get_running_loop().time(),
                priority=request.priority,
                logprobs=_alternatives(params.logprobs),
                block_hashes=()
                if self.prefix_cache is None
                else block_hashes(prompt_ids, self.prefix_cache.block_tokens, request.cache_salt),
            )
        )
        self._work.set()

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        if not self.resources.engine_dead:
            self.batch.abort(request_ids)

    async def get_output_async(self) -> Any:
        """The outputs of the next engine step, once its simulated time has passed.

        Paused, an empty output (scheduler stats only) every ``HEARTBEAT_S``; hung, nothing;
        dead, vLLM's ``EngineDeadError``, as its client raises when the engine core died.
        """
        loop = asyncio.get_running_loop()
        while True:
            if self.resources.engine_dead:
                raise EngineDeadError(suppress_context=True)
            if self.switches.hung:
                await _wait(self._controlled)
                continue
            if self.switches.paused:
                if await _wait(self._controlled, self._next_heartbeat_s - loop.time()):
                    continue
                self._next_heartbeat_s = loop.time() + HEARTBEAT_S
                return EngineCoreOutputs(outputs=[], scheduler_stats=self._scheduler_stats())
            if not self.batch.running:  # idle until now: the next step starts now
                self._clock_s = max(self._clock_s, loop.time())
            step = self.batch.schedule(self._clock_s)
            if step is None:
                await _wait(self._work)
                continue
            end_s = step.start_s + step.duration_s * self.switches.pace
            # Always yield, even when behind: the output handler must not starve the loop.
            await asyncio.sleep(max(0.0, end_s - loop.time()))
            self._clock_s = end_s
            emitted = self.batch.complete(step)
            self.steps += 1
            self.tokens += len(emitted)
            self.busy_s += end_s - step.start_s
            return EngineCoreOutputs(
                outputs=[_engine_core_output(e, self.batch.vocabulary) for e in emitted],
                scheduler_stats=self._scheduler_stats(),
            )

    def control(self, control: Control, pace: float | None = None) -> EngineState:
        """Apply ``control`` and return the state after it (see :class:`Control`).

        A step under way when the engine is paused, hung or failed still ends and
        delivers its tokens, as a GPU finishes the step it has launched.
        """
        if control is Control.FAIL:
            self.resources.engine_dead = True
        else:
            was_held = self.switches.paused or self.switches.hung
            self.switches.apply(control, pace)
            loop = asyncio.get_running_loop()
            if was_held and not (self.switches.paused or self.switches.hung):
                self._clock_s = loop.time()  # the next step starts now: no catching up on the pause
            self._next_heartbeat_s = loop.time() + HEARTBEAT_S
        self._controlled.set()
        self._work.set()
        return self.state()

    def state(self) -> EngineState:
        return EngineState(
            paused=self.switches.paused,
            hung=self.switches.hung,
            dead=self.resources.engine_dead,
            pace=self.switches.pace,
            running=len(self.batch.running),
            waiting=len(self.batch.waiting),
            steps=self.steps,
            tokens=self.tokens,
            busy_s=self.busy_s,
        )

    def _scheduler_stats(self) -> Any:
        stats = SchedulerStats(
            num_running_reqs=len(self.batch.running),
            num_waiting_reqs=len(self.batch.waiting),
            kv_cache_usage=self.batch.kv_usage,
        )
        if self.prefix_cache is not None:
            stats.prefix_cache_stats = PrefixCacheStats(**asdict(self.prefix_cache.take_tally()))
        return stats

    def dp_engines_running(self) -> bool:
        return False

    # What vLLM's API server calls outside generation: nothing of it is simulated.
    async def reset_mm_cache_async(self) -> None:
        """No multimodal cache (vLLM's API server resets it at start)."""

    async def reset_prefix_cache_async(self, *args: Any, **kwargs: Any) -> bool:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return True

    async def is_sleeping_async(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Nothing to stop: no process, no thread (AsyncLLM cancels its output handler)."""


async def _wait(event: asyncio.Event, timeout_s: float | None = None) -> bool:
    """Wait for ``event`` (then clear it) at most ``timeout_s``; whether it was set."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s if timeout_s is None else max(0.0, timeout_s))
    except TimeoutError:
        return False
    event.clear()
    return True


def _engine_core_output(emitted: Emitted, vocabulary: Sequence[int]) -> Any:
    sequence = emitted.sequence
    events = None
    if sequence.events:
        events = [EngineCoreEvent(EngineCoreEventType(kind.value), at) for kind, at in sequence.events]
        sequence.events.clear()
    prefill_stats = None
    if sequence.output_tokens == 1:  # the prompt's prefill ended with this token
        prefill_stats = PrefillStats()
        prefill_stats.set(sequence.prompt_tokens, sequence.cached_tokens, 0)
    finish = None
    if emitted.finish is not None:
        finish = FinishReason.STOP if emitted.finish is Finish.STOP else FinishReason.LENGTH
    return EngineCoreOutput(
        request_id=sequence.request_id,
        new_token_ids=[emitted.token],
        new_logprobs=None if sequence.logprobs is None else _logprobs(emitted.token, sequence.logprobs, vocabulary),
        finish_reason=finish,
        stop_reason=emitted.stop_reason,
        events=events,
        prefill_stats=prefill_stats,
    )


def _alternatives(logprobs: int | None) -> int | None:
    """Alternatives per token a request's ``logprobs`` asks for (-1, the whole vocabulary: the cap)."""
    if logprobs is None:
        return None
    return MAX_LOGPROBS if logprobs < 0 else min(logprobs, MAX_LOGPROBS)


def _logprobs(token: int, alternatives: int, vocabulary: Sequence[int]) -> Any:
    """The token's log-probability under the simulator's uniform draw, and ``alternatives`` other
    tokens of the vocabulary, all equally likely, in the shape vLLM's sampler reports."""
    others = [t for t in vocabulary[: alternatives + 1] if t != token][:alternatives]
    ids = np.array([[token, *others]], dtype=np.int32)
    logprobs = np.full(ids.shape, -math.log(len(vocabulary)), dtype=np.float32)
    return LogprobsLists(ids, logprobs, np.array([1], dtype=np.int32))


def simulated_async_llm(vllm_config: Any, config: SimulatedEngineConfig, **async_llm_args: Any) -> Any:
    """vLLM's ``AsyncLLM`` for ``vllm_config``, generating with a :class:`SimulatedEngineCore`.

    ``async_llm_args`` are those of ``AsyncLLM.from_vllm_config`` (stat loggers, request logging).
    """
    return vllm_internals.async_llm_on_core(vllm_config, simulated_core_factory(config), **async_llm_args)


def simulated_core_factory(config: SimulatedEngineConfig) -> Callable[[Any, Any], SimulatedEngineCore]:
    """What builds the engine core for an ``AsyncLLM`` (see :func:`serve_app.vllm_internals.engine_core_replaced`)."""
    return lambda vllm_config, renderer: SimulatedEngineCore(vllm_config, renderer.tokenizer, config)
