"""The topics a test or benchmark runs workers on, made fresh for each run."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from worker.dev.broker import new_topics


class TopicFactory(Protocol):
    """Creates a uniquely named topic and returns its name (the tests' `new_topic` fixture)."""

    async def __call__(
        self,
        partitions: int = 1,
        *,
        configs: Mapping[str, str] | None = None,
        bootstrap_servers: str | None = None,
    ) -> str: ...


@dataclass
class Topics:
    jobs: str
    results: str
    dlq: str
    group: str = field(default_factory=lambda: f"group-{uuid.uuid4().hex[:8]}")
    #: The static member id of spawned workers: a restart with it takes the partitions back.
    instance: str = field(default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}")


async def make_topics(
    new_topic: TopicFactory,
    *,
    jobs_partitions: int = 1,
    results_partitions: int = 1,
    results_configs: dict[str, str] | None = None,
    bootstrap_servers: str | None = None,
) -> Topics:
    """Fresh jobs, results and dead-letter topics (on the shared broker unless told otherwise)."""
    return Topics(
        jobs=await new_topic(jobs_partitions, bootstrap_servers=bootstrap_servers),
        results=await new_topic(
            results_partitions, configs=results_configs, bootstrap_servers=bootstrap_servers
        ),
        dlq=await new_topic(1, bootstrap_servers=bootstrap_servers),
    )


async def new_run_topics(bootstrap: str, prefix: str, jobs_partitions: int) -> Topics:
    """Fresh jobs (`jobs_partitions`), results and dead-letter topics named `prefix-...`, for a
    run outside the tests (no fixture deletes them)."""
    jobs = (await new_topics(bootstrap, 1, prefix=prefix, partitions=jobs_partitions))[0]
    results, dlq = await new_topics(bootstrap, 2, prefix=prefix)
    return Topics(jobs=jobs, results=results, dlq=dlq)


@dataclass
class Fleet:
    """Topics for workers steered by a control plane: jobs, results, dead letters, control,
    status (one partition each)."""

    topics: Topics
    control: str
    status: str


async def make_fleet(new_topic: TopicFactory, jobs_partitions: int = 1) -> Fleet:
    return Fleet(
        topics=await make_topics(new_topic, jobs_partitions=jobs_partitions),
        control=await new_topic(1),
        status=await new_topic(1),
    )
