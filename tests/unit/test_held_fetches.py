"""worker.dev.held_fetches: an empty fetch is held until the hold ends or records are announced;
a fruitful one is not held."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.consumer.fetcher import Fetcher

from worker.dev import held_fetches

# Longer than any test runs: a hold that ends did so because it was woken.
FOREVER_S = 3600.0


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """aiokafka's fetch replaced by a scripted one (restored after the test)."""
    state: dict[str, Any] = {"found": False, "calls": 0, "during": None}

    async def fetch(self: Any, *args: Any) -> bool:
        state["calls"] += 1
        if state["during"] is not None:
            state["during"]()
        return bool(state["found"])

    monkeypatch.setattr(Fetcher, "_proc_fetch_request", fetch)
    return state


def fetch_once() -> asyncio.Task[bool]:
    return asyncio.create_task(Fetcher._proc_fetch_request(object(), "assignment", 0, "request"))


async def turns(count: int = 5) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_an_empty_fetch_is_held_until_records_are_announced(
    fetches: dict[str, Any],
) -> None:
    held_fetches.hold_empty_fetches(FOREVER_S)
    task = fetch_once()
    await turns()
    assert fetches["calls"] == 1
    assert not task.done(), "an empty fetch must be held"
    held_fetches.wake_held_fetches()
    assert await asyncio.wait_for(task, 10) is False


async def test_an_empty_fetch_is_held_no_longer_than_the_hold(fetches: dict[str, Any]) -> None:
    held_fetches.hold_empty_fetches(0.01)
    assert await asyncio.wait_for(fetch_once(), 10) is False


async def test_a_fetch_that_brought_records_is_not_held(fetches: dict[str, Any]) -> None:
    held_fetches.hold_empty_fetches(FOREVER_S)
    fetches["found"] = True
    task = fetch_once()
    await turns()
    assert task.done() and task.result() is True


async def test_records_announced_while_a_fetch_was_on_its_way_skip_its_hold(
    fetches: dict[str, Any],
) -> None:
    # The fetch may have reached the broker before the records did.
    held_fetches.hold_empty_fetches(FOREVER_S)
    fetches["during"] = held_fetches.wake_held_fetches
    task = fetch_once()
    await turns()
    assert task.done() and task.result() is False


async def test_a_cancelled_hold_ends_like_a_cancelled_fetch(fetches: dict[str, Any]) -> None:
    # aiokafka's fetcher cancels its fetches on close and awaits them without expecting the
    # cancellation back: its own fetch returns False then, and so must the hold.
    held_fetches.hold_empty_fetches(FOREVER_S)
    task = fetch_once()
    await turns()
    task.cancel()
    assert await asyncio.wait_for(task, 10) is False


def test_holding_twice_or_for_no_time_is_refused(fetches: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="positive"):
        held_fetches.hold_empty_fetches(0)
    held_fetches.hold_empty_fetches(0.02)
    with pytest.raises(RuntimeError, match="already"):
        held_fetches.hold_empty_fetches(0.02)


def test_the_runner_says_how_to_call_it_without_arguments() -> None:
    with pytest.raises(SystemExit, match="HOLD_S"):
        held_fetches.main([])
