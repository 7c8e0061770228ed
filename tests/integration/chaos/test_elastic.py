"""Scale out and in under load on real processes and a real broker: worker A alone, B joins, C
joins, A leaves by SIGTERM. A join or a leave re-runs at most what was in flight, and blames
nobody: a failed hand-over is not a death. The full run is `bench/elastic.py`."""

from __future__ import annotations

from typing import Any

import pytest

from worker.dev.harness.elastic import Elastic, ElasticPlan
from worker.dev.harness.topics import make_topics

pytestmark = [pytest.mark.broker, pytest.mark.chaos, pytest.mark.timeout(600)]

# 4 tokens x 50 ms: 0.2 s a job, 16 at once: about 80 jobs/s a worker.
SHORT = ElasticPlan(
    jobs=1200,
    tokens=4,
    max_in_flight=16,
    join_b_at=150,
    join_c_at=450,
    leave_a_at=800,
    revoke_grace_s=5.0,
)


async def test_joins_and_a_leave_on_the_embedded_broker_blame_nobody(
    kafka_bootstrap_servers: str, new_topic: Any, spawn: Any
) -> None:
    topics = await make_topics(new_topic, jobs_partitions=SHORT.partitions)
    figures = await Elastic(kafka_bootstrap_servers, topics, spawn, SHORT).run()
    print("\n".join(figures.lines()))
    assert figures.lost == 0
    assert figures.dead_lettered == 0 and figures.failed == 0
    assert figures.blamed == 0, "a scale event was taken for a death"
    assert figures.duplicates <= figures.in_flight_at_events
    assert figures.committed_at_end


async def test_joins_and_a_leave_on_a_kafka_like_broker_repeat_nothing(
    tansu_broker: Any, new_topic: Any, spawn: Any
) -> None:
    bs = tansu_broker.bootstrap_servers
    topics = await make_topics(new_topic, jobs_partitions=SHORT.partitions, bootstrap_servers=bs)
    plan = ElasticPlan(
        **{**SHORT.__dict__, "flags": {"bootstrap": bs, "enable_idempotence": False}}
    )
    figures = await Elastic(bs, topics, spawn, plan).run()
    print("\n".join(figures.lines()))
    assert figures.lost == 0
    assert figures.dead_lettered == 0 and figures.failed == 0
    assert figures.blamed == 0
    assert figures.answered_twice == 0
    assert figures.committed_at_end
