"""Whether the last owner is alive, asked while the group rebalances again.

Apache Kafka's coordinator returns the members' metadata (where each worker announces its
incarnation) in DescribeGroups only while the group is Stable; during back-to-back rebalances
every member comes back without it. Read as "no live member announces that incarnation", a live
member whose hand-over had not landed yet counted as dead, and its jobs in flight as present at
a death: they then ran one at a time, as suspects of a crash.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeAlias

from aiokafka import TopicPartition
from aiokafka.errors import GroupCoordinatorNotAvailableError, KafkaError
from aiokafka.protocol.admin import DescribeGroupsResponse_v1

from tests.fakes import FakeConsumer, run_on_virtual_time
from worker.core.config import settings_from
from worker.core.incarnation import incarnation_assignor, incarnations_of_members, new_incarnation
from worker.core.metrics import Metrics
from worker.delivery.commits import Committer
from worker.delivery.offset_map import encode_offset_map

TP = TopicPartition("jobs", 0)


def _description(state: str, members: list[bytes]) -> Any:
    return DescribeGroupsResponse_v1(
        throttle_time_ms=0,
        groups=[
            (
                0,
                "g",
                state,
                "consumer",
                "roundrobin" if state == "Stable" else "",
                [(f"m{i}", "client", "/127.0.0.1", m, b"") for i, m in enumerate(members)],
            )
        ],
    )


def test_a_group_that_is_rebalancing_says_nothing_about_who_is_alive():
    ours = new_incarnation()
    announced = incarnation_assignor(ours).metadata(["jobs"]).encode()
    assert incarnations_of_members([_description("Stable", [announced])], "g") == {ours}
    # Kafka's summaryNoMetadata: the members, none of their metadata.
    assert incarnations_of_members([_description("PreparingRebalance", [b""])], "g") is None
    assert incarnations_of_members([_description("CompletingRebalance", [b""])], "g") is None


def test_a_stable_group_whose_members_carry_no_metadata_says_nothing_about_who_is_alive():
    # tansu never returns member metadata (the simulation's `Flavour.TANSU`; seed 72088 of
    # `bench/sim.py --flavour tansu`): read as "no live member announces that incarnation",
    # every live last owner counted as dead, its new owner did not wait for the hand-over, and
    # committed behind it once it landed. The asking worker is a member that announces itself,
    # so a group where nobody does is the broker keeping quiet.
    ours = new_incarnation()
    announced = incarnation_assignor(ours).metadata(["jobs"]).encode()
    assert incarnations_of_members([_description("Stable", [b"", b""])], "g") is None
    assert incarnations_of_members([_description("Stable", [announced, b""])], "g") == {ours}
    assert incarnations_of_members([_description("Empty", [])], "g") == set()


def _committer(reads: list[str], live: set[int] | None) -> Committer:
    return _committer_answering(reads, [live])


#: What a read of the committed offsets gives: a map at position 0, a (position, map), or an
#: error the read raises.
Read: TypeAlias = str | tuple[int, str] | KafkaError


def _committer_answering(
    reads: Sequence[Read],
    answers: list[set[int] | KafkaError | None],
    asked: list[float] | None = None,
) -> Committer:
    """A committer whose reads of the committed offsets give `reads`, and whose group answers
    "who is alive" with `answers`, one per ask (the last one from then on): a set of
    incarnations, None (rebalancing) or an error it raises."""
    consumer = FakeConsumer()
    for _ in range(10):
        consumer.add(TP, b"{}")
    pending = list(reads)

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        read = pending.pop(0) if len(pending) > 1 else pending[0]
        if isinstance(read, KafkaError):
            raise read
        return {TP: (0, read) if isinstance(read, str) else read}

    async def live_incarnations() -> set[int] | None:
        if asked is not None:
            asked.append(asyncio.get_running_loop().time())
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, KafkaError):
            raise answer
        return answer

    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    return Committer(
        consumer, settings, Metrics(), read_committed, live_incarnations=live_incarnations
    )


async def test_a_live_member_whose_hand_over_lands_while_the_group_rebalances_blames_nobody():
    writer = new_incarnation()
    reads = [
        encode_offset_map(0, [2], running=[0, 1, 3], writer=writer),
        encode_offset_map(0, [2], running=[0, 1, 3], writer=writer),
        encode_offset_map(0, [0, 1, 2, 3], clean=True, writer=writer),
    ]
    committer = _committer(reads, live=None)
    await committer.assigned({TP})
    partition = committer.partition(TP)
    assert partition.deaths == {}
    assert partition.answered_before == {0, 1, 2, 3}


def test_a_member_whose_hand_over_never_lands_while_the_group_rebalances_counts_as_dead():
    # Nothing tells a dead writer from a live one then but its hand-over, which a live member
    # makes as soon as it rejoins: without it, and with the group unable to say even when asked
    # again, the breaker stays on the safe side.
    writer = new_incarnation()

    async def inherit() -> None:
        committer = _committer(
            [encode_offset_map(0, [2], running=[1, 3], writer=writer)], live=None
        )
        await committer.assigned({TP})
        assert committer.partition(TP).deaths == {1: 1, 3: 1}

    run_on_virtual_time(inherit())


def test_a_live_member_the_group_vouches_for_once_asked_again_blames_nobody():
    # Seed 71239 (`bench/sim.py --flavour noida --static`): a broker outage began as the group
    # formed; the new owner could not ask who was alive, counted the live last owner (its
    # hand-over refused during the rebalance) as dead, and its job in flight as a suspect.
    # Asked again after the wait for the hand-over, the group vouches for it.
    writer = new_incarnation()

    async def inherit(first: KafkaError | None) -> None:
        committer = _committer_answering(
            [encode_offset_map(0, [2], running=[1, 3], writer=writer)], [first, {writer}]
        )
        await committer.assigned({TP})
        assert committer.partition(TP).deaths == {}, first

    for first in (GroupCoordinatorNotAvailableError(), None):
        run_on_virtual_time(inherit(first))


def test_a_writer_the_group_cannot_vouch_for_when_asked_again_counts_as_dead():
    writer = new_incarnation()

    async def inherit(again: set[int] | KafkaError | None) -> None:
        committer = _committer_answering(
            [encode_offset_map(0, [2], running=[1, 3], writer=writer)],
            [GroupCoordinatorNotAvailableError(), again],
        )
        await committer.assigned({TP})
        assert committer.partition(TP).deaths == {1: 1, 3: 1}, again

    answers: list[set[int] | KafkaError | None] = [GroupCoordinatorNotAvailableError(), None, set()]
    for again in answers:
        run_on_virtual_time(inherit(again))


def test_the_group_is_asked_again_while_its_coordinator_does_not_answer_and_once_otherwise():
    """A coordinator that does not answer is asked every 0.5 s for up to --commit-timeout-s
    (10 s); a group that answers that it cannot say (rebalancing, or a broker that never
    returns member metadata) once more, after the wait for the hand-over."""
    writer = new_incarnation()

    async def asks(again: KafkaError | None) -> list[float]:
        asked: list[float] = []
        committer = _committer_answering(
            [encode_offset_map(0, [2], running=[1, 3], writer=writer)], [None, again], asked
        )
        await committer.assigned({TP})
        assert committer.partition(TP).deaths == {1: 1, 3: 1}
        return asked

    assert len(run_on_virtual_time(asks(None))) == 2
    retried = run_on_virtual_time(asks(GroupCoordinatorNotAvailableError()))
    assert 15 <= len(retried) <= 25
    assert 9.5 <= retried[-1] - retried[1] <= 10.5


def test_a_hand_over_that_lands_while_the_coordinator_cannot_be_read_is_waited_for():
    # Seed 81012 (`bench/sim.py --workers 16 --flavour noida --static`): the new owner read the
    # live last owner's map, the hand-over landed just after, and the coordinator went away;
    # every read again failed, the wait for the hand-over ended after 2 s, and the new owner
    # fetched from the position read before: its first commit moved the position back.
    writer = new_incarnation()

    async def inherit() -> dict[TopicPartition, int]:
        committer = _committer_answering(
            [
                encode_offset_map(0, [], running=[0], writer=writer),
                *[GroupCoordinatorNotAvailableError()] * 40,  # 4 s at one read every 0.1 s
                (1, encode_offset_map(1, [], clean=True, writer=writer)),
            ],
            [{writer}],
        )
        positions = await committer.assigned({TP})
        assert committer.partition(TP).deaths == {}
        return positions

    assert run_on_virtual_time(inherit()) == {TP: 1}


def test_the_first_read_at_an_assignment_is_made_again_while_the_coordinator_cannot_be_read():
    # Seed 88476 (`bench/sim.py --flavour noida --static`): a broker outage began as the group
    # formed; the new owner's first read of the committed offsets failed, it fetched from the
    # position aiokafka had looked up as it joined, older than the hand-over the last owner
    # landed just after, and its first commit moved the position back.
    writer = new_incarnation()

    async def inherit() -> dict[TopicPartition, int]:
        committer = _committer_answering(
            [
                *[GroupCoordinatorNotAvailableError()] * 20,  # 2 s at one read every 0.1 s
                (1, encode_offset_map(1, [], clean=True, writer=writer)),
            ],
            [{writer}],
        )
        return await committer.assigned({TP})

    assert run_on_virtual_time(inherit()) == {TP: 1}


def _first_commits(reads: Sequence[Read]) -> tuple[FakeConsumer, Committer]:
    """A new owner that could not read the partition's map at its assignment (the reads fail
    for all of --commit-timeout-s), started records 0 and 1 from position 0 and answered 1;
    its reads of the committed offsets give `reads` from then on, one each (the last one
    from then on)."""
    consumer = FakeConsumer()
    for _ in range(10):
        consumer.add(TP, b"{}")
    pending: list[Read] = []

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        if not pending:
            raise GroupCoordinatorNotAvailableError()
        read = pending.pop(0) if len(pending) > 1 else pending[0]
        if isinstance(read, KafkaError):
            raise read
        return {TP: (0, read) if isinstance(read, str) else read}

    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    committer = Committer(consumer, settings, Metrics(), read_committed)

    async def assign_and_answer() -> None:
        assert await committer.assigned({TP}) == {}
        partition = committer.partition(TP)
        assert partition.start(0) and partition.start(1)
        partition.finish(1)

    run_on_virtual_time(assign_and_answer())
    pending.extend(reads)
    return consumer, committer


def test_a_hand_over_that_landed_after_the_map_was_read_is_taken_over_not_committed_behind():
    # Seed 89102 (`bench/sim.py --flavour noida --static`): a coordinator outage began as the
    # group formed; the new owner could not read the committed offsets for longer than its
    # bounded waits and fetched from the position aiokafka looked up as it joined. The last
    # owner's hand-over landed just before the outage, and once the coordinator was back the
    # new owner's first commit moved the position back, from 17 to 16.
    writer = new_incarnation()
    landed = (2, encode_offset_map(2, [3], clean=True, writer=writer))
    consumer, committer = _first_commits([landed])
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == []  # not at 0, behind the hand-over at 2
    partition = committer.partition(TP)
    # Below 2 the last owner answered; 3 it answered too: skipped as fetched.
    assert partition.start(2) and not partition.start(3) and partition.start(4)
    partition.finish(2)
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == [{TP: 4}]


def test_a_first_commit_waits_while_the_committed_offsets_cannot_be_read():
    consumer, committer = _first_commits([GroupCoordinatorNotAvailableError(), (0, "")])
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == []
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == [{TP: 0}]
    # Once one landed, commits are made without reading first.
    committer.partition(TP).finish(0)
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits[-1] == {TP: 2}


def test_a_first_commit_ahead_of_what_another_member_committed_since_is_made():
    consumer, committer = _first_commits([(0, encode_offset_map(0, [1], clean=True))])
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == [{TP: 0}]


def test_a_committed_position_past_the_log_end_is_a_truncated_log_not_a_hand_over():
    # The log was truncated under the commit: the consumer's reset to its start stands.
    consumer, committer = _first_commits([(50, "")])
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == [{TP: 0}]


def test_a_newer_position_is_neither_taken_over_nor_committed_behind_while_the_log_end_is_unknown():
    # Ahead of the commit: a hand-over, or a log truncated under the commit; only the log's end
    # tells them apart.
    consumer, committer = _first_commits([(2, "")])

    async def no_end_offsets(tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        raise GroupCoordinatorNotAvailableError()

    consumer.end_offsets = no_end_offsets  # type: ignore[method-assign]
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == [] and committer.partition(TP).floor == 0


def test_a_forged_map_ahead_of_a_first_commit_costs_only_its_own_map():
    # Anyone who can commit to the group can write any metadata: ahead of this owner and
    # within the log, the position is taken over and the unreadable map ignored, with a warning.
    consumer, committer = _first_commits([(2, "vkw2:not-a-map!")])
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == []
    partition = committer.partition(TP)
    assert partition.floor == 2 and partition.answered_before == set()
    assert partition.start(2) and partition.start(3)
    partition.finish(2)
    run_on_virtual_time(committer.commit_now())
    assert consumer.commits == [{TP: 3}]


def test_a_partition_whose_map_cannot_be_read_is_held_until_it_is_and_its_suspects_are_known():
    # Seed 930013 of the hostile flag set (8 workers): a worker joined as the coordinator went
    # away, could not read the map of a partition within its read window and started its 14
    # records together, one of them in flight at two deaths by that map: the breaker runs
    # such a record alone, and could not know.
    consumer = FakeConsumer()
    for _ in range(4):
        consumer.add(TP, b"{}")
    reads: list[dict[TopicPartition, tuple[int, str]]] = []

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        if not reads:
            raise GroupCoordinatorNotAvailableError()
        return reads[0]

    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    committer = Committer(consumer, settings, Metrics(), read_committed)

    async def assign_then_read_again() -> tuple[set[TopicPartition], dict[TopicPartition, int]]:
        assert await committer.assigned({TP}) == {}
        held = committer.held()
        assert await committer.read_unread() == {}  # still away: still held
        assert TP in committer.held()
        reads.append({TP: (1, encode_offset_map(1, [], running=[1], deaths={1: 2}))})
        return held, await committer.read_unread()

    held, positions = run_on_virtual_time(assign_then_read_again())
    assert TP in held
    assert positions == {TP: 1}
    assert TP not in committer.held() and committer.unread == set()
    assert committer.partition(TP).deaths == {1: 3}


def test_a_partition_whose_read_failed_while_unread_maps_were_read_again_stays_unread():
    # The maps of the unread partitions are read again in the background; a partition
    # assigned meanwhile whose own read failed was not asked for, and must not be taken as read.
    later = TopicPartition(TP.topic, TP.partition + 1)
    consumer = FakeConsumer()
    consumer.add(TP, b"{}")
    away = [True]
    committer: Committer

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        if away[0]:
            raise GroupCoordinatorNotAvailableError()
        committer.unread.add(later)  # assigned, and unread, during this read
        return {TP: (0, "")}

    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    committer = Committer(consumer, settings, Metrics(), read_committed)

    async def assign_then_read_again() -> dict[TopicPartition, int]:
        await committer.assigned({TP})
        away[0] = False
        return await committer.read_unread()

    assert TP in run_on_virtual_time(assign_then_read_again())
    assert committer.unread == {later} and later in committer.held()


def test_a_partition_whose_map_is_read_again_stays_held_until_its_position_is_settled():
    # Seed 6470949 of the late_hand_overs flag set (3 workers): a member joined as the
    # coordinator went away, just before the last owner's hand-over landed, and could not read
    # the partition's map. Read again once the coordinator was back, the partition was let go
    # as the read began, while the map was still being taken (the hand-over of the live last
    # owner awaited, the log's end looked up): the loop fetched it from the position the
    # consumer had looked up as it joined, behind the hand-over, and committed behind it.
    consumer = FakeConsumer()
    for _ in range(4):
        consumer.add(TP, b"{}")
    last_owner = new_incarnation()
    reads: list[dict[TopicPartition, tuple[int, str]]] = []

    async def read_committed(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        if not reads:
            raise GroupCoordinatorNotAvailableError()
        return reads[0]

    async def live() -> set[int]:
        return {last_owner}

    settings = settings_from({"jobs_topic": "jobs", "results_topic": "r", "engine": "mock"}, {})
    committer = Committer(consumer, settings, Metrics(), read_committed, live_incarnations=live)

    async def assign_then_read_again() -> tuple[bool, dict[TopicPartition, int]]:
        assert await committer.assigned({TP}) == {}
        # Its last owner, alive, named record 1 running: its hand-over is waited for.
        reads.append({TP: (1, encode_offset_map(1, [], running=[1], writer=last_owner))})
        rereading = asyncio.create_task(committer.read_unread())
        await asyncio.sleep(0.5)
        held_while_taken = TP in committer.held()
        return held_while_taken, await rereading

    held_while_taken, positions = run_on_virtual_time(assign_then_read_again())
    assert held_while_taken
    assert positions == {TP: 1}
    assert TP not in committer.held() and committer.unread == set()
