"""Sessions on a real broker: two workers in one group, conversations keyed by session.

Every turn of a keyed conversation reaches the worker that served the turn before, whose
prefix cache (the mock engine's, blocks of 16 tokens) holds it; a rebalance costs a moved
session its cache once, and the turns after it are cached on the new owner.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka.partitioner import DefaultPartitioner

from schemas import Completed, SamplingSpec
from worker.client.conversation import Conversation
from worker.client.rollout import RolloutClient
from worker.dev.harness.topics import make_topics
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MOCK_BLOCK_SIZE, MockEngine, MockEngineSettings

pytestmark = pytest.mark.broker

PARTITIONS = 4
SAMPLING = SamplingSpec(max_tokens=6, ignore_eos=True)


def sessions_on_every_partition() -> list[str]:
    """One session id per partition, by the producer's own partitioner (murmur2 of the key)."""
    partitioner = DefaultPartitioner()
    chosen: dict[int, str] = {}
    for n in itertools.count():
        session = f"session-{n}"
        chosen.setdefault(partitioner(session.encode(), list(range(PARTITIONS)), None), session)
        if len(chosen) == PARTITIONS:
            return [chosen[p] for p in range(PARTITIONS)]
    raise AssertionError("unreachable")


def new_tokens(turn: int, conversation: int) -> list[int]:
    count = 70 if turn == 0 else 20
    return [(31 * conversation + 7 * turn + 3 * i) % 400 + 1 for i in range(count)]


def ideal(history: int) -> int:
    """Every earlier turn cached: its whole blocks but the last token's."""
    return max(history - 1, 0) // MOCK_BLOCK_SIZE * MOCK_BLOCK_SIZE


async def turns_of_all(
    client: RolloutClient, conversations: list[Conversation], turn: int
) -> list[tuple[int, Completed]]:
    """One turn of every conversation at once; each one's history length and answer."""

    async def one(number: int, conversation: Conversation) -> tuple[int, Completed]:
        history = len(conversation.token_ids)
        result = await client.turn(conversation, new_tokens(turn, number))
        assert isinstance(result, Completed), result
        return history, result

    return list(await asyncio.gather(*(one(n, c) for n, c in enumerate(conversations))))


async def two_workers(
    start_worker: Callable[..., Any], topics: Any, *, static: bool = False, **settings: Any
) -> list[Any]:
    """Workers "a" and "b", each with a mock engine (and its cache) of its own, once they share
    the partitions; `static`: each a static member under its own name."""
    workers = []
    for name in ("a", "b"):
        engine = MockEngine(MockEngineSettings(num_layers=3, top_k=2))
        if static:
            settings["group_instance_id"] = name
        workers.append(await start_worker(topics, engine, worker_id=name, **settings))
    for worker in workers:
        await worker.serving(60)
    await wait_for(
        lambda: all(len(w.worker.assignment()) == PARTITIONS // 2 for w in workers),
        60,
        "the two workers to share the partitions",
    )
    return workers


async def test_every_turn_of_a_session_reaches_the_worker_that_cached_the_turns_before(
    kafka_bootstrap_servers: str, new_topic: Any, start_worker: Callable[..., Any]
) -> None:
    bs = kafka_bootstrap_servers
    topics = await make_topics(new_topic, jobs_partitions=PARTITIONS)
    # Static members: stopped together, one's leave moved the generation on noida-db before the
    # other's last commit landed (Kafka accepts a commit of the current generation until the
    # rebalance completes: apache/kafka group-coordinator, ClassicGroup.validateOffsetCommit and
    # initNextGeneration); the refused commit made aiokafka forget the member id, and noida-db,
    # which never evicts, held the new member's join for ever waiting on the old id. A static
    # member rejoins in its own place.
    await two_workers(start_worker, topics, static=True)
    conversations = [Conversation(s, sampling=SAMPLING) for s in sessions_on_every_partition()]
    async with RolloutClient(
        bootstrap_servers=bs, jobs_topic=topics.jobs, results_topic=topics.results, timeout_s=60
    ) as client:
        for turn in range(4):
            for history, result in await turns_of_all(client, conversations, turn):
                assert result.cached_prompt_tokens == ideal(history)

    served = [{r.worker for r in c.results} for c in conversations]
    assert all(len(s) == 1 for s in served), served
    # The sessions cover every partition, so both workers served some.
    assert set().union(*served) == {"a", "b"}


async def test_a_rebalance_costs_a_moved_session_its_cache_once(
    tansu_broker: Any, new_topic: Any, start_worker: Callable[..., Any]
) -> None:
    # On tansu: the local noida-db broker does not hand a departed group leader's partitions on.
    bs = tansu_broker.bootstrap_servers
    topics = await make_topics(new_topic, jobs_partitions=PARTITIONS, bootstrap_servers=bs)
    a, b = await two_workers(start_worker, topics, bootstrap_servers=bs, enable_idempotence=False)
    conversations = [Conversation(s, sampling=SAMPLING) for s in sessions_on_every_partition()]
    async with RolloutClient(
        bootstrap_servers=bs, jobs_topic=topics.jobs, results_topic=topics.results, timeout_s=60
    ) as client:
        first = await turns_of_all(client, conversations, 0)
        # a leaves the group: its sessions move to b, whose cache never saw them.
        assert await a.stop() == 0
        await wait_for(
            lambda: len(b.worker.assignment()) == PARTITIONS, 60, "b to own every partition"
        )
        second = await turns_of_all(client, conversations, 1)
        third = await turns_of_all(client, conversations, 2)

    moved = [r.worker == "a" for _, r in first]
    assert any(moved) and not all(moved)
    for was_on_a, (history, result) in zip(moved, second, strict=True):
        assert result.worker == "b"
        assert result.cached_prompt_tokens == (0 if was_on_a else ideal(history))
    for history, result in third:
        assert result.worker == "b"
        assert result.cached_prompt_tokens == ideal(history)
