"""Waiting in tests: on a condition, with a bound, never for a fixed time.

Every test and fixture that waits for something uses :func:`wait_until` (in a coroutine)
or :func:`wait_until_blocking` (in plain code: a fixture starting a process): both poll a
condition until it returns something true, return that value, and fail naming what was
awaited once the bound has passed. The bound is a backstop for a broken system, not a
timing the test asserts.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

EVERY_S = 0.25  # how often a condition is asked again by default


@overload
async def wait_until(
    condition: Callable[[], Awaitable[T | None]], within_s: float, what: str, every_s: float = EVERY_S
) -> T: ...


@overload
async def wait_until(condition: Callable[[], T | None], within_s: float, what: str, every_s: float = EVERY_S) -> T: ...


async def wait_until(condition: Callable[[], Any], within_s: float, what: str, every_s: float = EVERY_S) -> Any:
    """Ask ``condition`` (a function or a coroutine function) until its answer is true; return it."""
    deadline = time.monotonic() + within_s
    while True:
        answer = condition()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        await asyncio.sleep(every_s)  # the interval between two askings of the condition


def wait_until_blocking(condition: Callable[[], T | None], within_s: float, what: str, every_s: float = EVERY_S) -> T:
    """:func:`wait_until` for code that is not a coroutine (it blocks its thread meanwhile)."""
    deadline = time.monotonic() + within_s
    while True:
        answer = condition()
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        time.sleep(every_s)  # the interval between two askings of the condition
