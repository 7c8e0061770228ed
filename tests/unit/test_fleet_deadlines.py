"""Every trainer call against the fleet ends by its deadline, even when a status partition
cannot be fetched (its leader unavailable: the end offset is known, no record ever comes)."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any
from unittest import mock

import pytest
from aiokafka import ConsumerRecord, TopicPartition

from worker.cli import control as control_cli
from worker.client.rollout import RolloutClient, RolloutError
from worker.core.clients import AIOKafkaClients
from worker.core.config import settings_from

STATUS, CONTROL = "deadline.status", "deadline.control"
TIMEOUT_S = 1.0
# What the calls may take past their deadline: the clients' own start and stop.
SLACK_S = 2.0


class LeaderlessStatus:
    """The status topic as a Fleet's consumer sees it with its partition's leader gone: the
    end offset says records are there, fetches return none of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.fetches = 0

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        return

    async def topics(self) -> set[str]:
        return {STATUS, CONTROL}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    def assign(self, tps: list[TopicPartition]) -> None:
        return

    def seek(self, tp: TopicPartition, offset: int) -> None:
        return

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 10)

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 0)

    async def position(self, tp: TopicPartition) -> int:
        return 0

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        self.fetches += 1
        await asyncio.sleep(timeout_ms / 1000)
        return {}


class Producer:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[bytes] = []

    async def start(self) -> None:
        return

    async def stop(self) -> None:
        return

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> None:
        self.sent.append(value)


@pytest.fixture
def leaderless() -> Any:
    with (
        mock.patch.object(AIOKafkaClients, "consumer", lambda self, *a, **k: LeaderlessStatus()),
        mock.patch.object(AIOKafkaClients, "producer", lambda self, **k: Producer()),
    ):
        yield


async def within_deadline(call: Any) -> Any:
    """`call`'s outcome; fails when it has not ended SLACK_S after its deadline (before the
    deadlines covered the reads of the status topic, each of these waited for ever)."""
    t0 = time.monotonic()
    try:
        return await asyncio.wait_for(call, TIMEOUT_S + SLACK_S)
    finally:
        assert time.monotonic() - t0 >= TIMEOUT_S * 0.9  # it did wait for the records


@pytest.mark.usefixtures("leaderless")
async def test_update_weights_ends_by_its_deadline_when_the_status_topic_cannot_be_read():
    client = RolloutClient(bootstrap_servers="unused:9092", status_topic=STATUS)
    with pytest.raises(RolloutError, match="not sent") as info:
        await within_deadline(client.update_weights("/w/step-3", 3, timeout_s=TIMEOUT_S))
    assert "live workers" in str(info.value)
    with pytest.raises(RolloutError, match="fleet status"):
        await within_deadline(client.status(timeout_s=TIMEOUT_S))


@pytest.mark.usefixtures("leaderless")
@pytest.mark.parametrize("wait", [True, False])
async def test_the_control_and_status_commands_end_by_their_deadline(wait, capsys):
    settings = settings_from(
        {"control_topic": CONTROL, "status_topic": STATUS, "group_id": "g"}, {}
    )
    args = argparse.Namespace(
        control_command="resume",
        command_id=None,
        target_worker=None,
        wait=wait,
        timeout_s=TIMEOUT_S,
    )
    if wait:
        assert await within_deadline(control_cli.run_control(args, settings)) == 1
        assert "live workers: nothing within" in capsys.readouterr().err
    else:  # nothing to read: sent at once
        assert await asyncio.wait_for(control_cli.run_control(args, settings), SLACK_S) == 0
    status_args = argparse.Namespace(all_groups=False, timeout_s=TIMEOUT_S)
    assert await within_deadline(control_cli.run_status(status_args, settings)) == 1
