"""worker.dev.held_fetches: an empty fetch is held before the next, a fruitful one is not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.consumer.fetcher import Fetcher

from worker.dev import held_fetches


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """aiokafka's fetch replaced by a scripted one (restored after the test), and the holds
    asyncio.sleep was asked for."""
    state: dict[str, Any] = {"found": False, "calls": 0, "holds": []}

    async def fetch(self: Any, *args: Any) -> bool:
        state["calls"] += 1
        return bool(state["found"])

    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        state["holds"].append(delay)
        await real_sleep(0)
        if state.get("cancel_hold"):
            raise asyncio.CancelledError

    monkeypatch.setattr(Fetcher, "_proc_fetch_request", fetch)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    return state


async def test_an_empty_fetch_is_held_before_the_fetcher_goes_on(fetches: dict[str, Any]) -> None:
    held_fetches.hold_empty_fetches(0.02)
    assert await Fetcher._proc_fetch_request(object(), "assignment", 0, "request") is False
    assert fetches["calls"] == 1
    assert fetches["holds"] == [0.02]


async def test_a_fetch_that_brought_records_is_not_held(fetches: dict[str, Any]) -> None:
    held_fetches.hold_empty_fetches(0.02)
    fetches["found"] = True
    assert await Fetcher._proc_fetch_request(object(), "assignment", 0, "request") is True
    assert fetches["holds"] == []


async def test_a_cancelled_hold_ends_like_a_cancelled_fetch(fetches: dict[str, Any]) -> None:
    # aiokafka's fetcher cancels its fetches on close and awaits them without expecting the
    # cancellation back: its own fetch returns False then, and so must the hold.
    held_fetches.hold_empty_fetches(0.02)
    fetches["cancel_hold"] = True
    assert await Fetcher._proc_fetch_request(object(), "assignment", 0, "request") is False


def test_holding_twice_or_for_no_time_is_refused(fetches: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="positive"):
        held_fetches.hold_empty_fetches(0)
    held_fetches.hold_empty_fetches(0.02)
    with pytest.raises(RuntimeError, match="already"):
        held_fetches.hold_empty_fetches(0.02)


def test_the_runner_says_how_to_call_it_without_arguments() -> None:
    with pytest.raises(SystemExit, match="HOLD_S"):
        held_fetches.main([])
