"""Probe: when does a broker accept member A's offset commits around a rebalance, and what does
DescribeGroups say about members (alive, dead)? Plain aiokafka 0.14; the project only starts the
brokers (worker.dev.broker).

Run `python bench/rebalance_probe.py [--broker noida|tansu|both] [--scenario NAME ...]
[--kill-only]` (from the repository root with PYTHONPATH=. or the project installed). Every wait
is bounded (a scenario 55 s at most, step 4 100 s at most); measured: noida 156 s, tansu 119 s
for all four scenarios and step 4. Only 127.0.0.1 is used. tansu runs with the producer's
idempotence off (it fails InitProducerId v0). Session timeout 6 s, heartbeat 0.5 s, round-robin
assignor, auto-commit off.

Per broker and scenario (A static with group_instance_id, or dynamic; A's own commits made as
raw OffsetCommit requests, or through `consumer.commit()` as a worker does):

1. Topic with 8 partitions, 10 records each. A joins alone, consumes, commits with metadata (S).
2. B joins; times are seconds from the start of B's join (t=0). A's commits, each with its own
   offset (S 1, a 2, b 3, c 4, d 5, e 6) and a metadata string naming the commit point:
   (a) a background loop, every 25 ms, of raw OffsetCommits for all 8 partitions with A's
       generation and member id as A's coordinator holds them at send time, sent on aiokafka's
       DEFAULT connection (not the coordinator connection, where a pending JoinGroup would queue
       them); printed as runs of identical answers, labelled with A's state (pre-revoke,
       in-revoke, rejoining, post-assign); the loop stops 1 s after A's reassignment;
   (b) in A's on_partitions_revoked, for the revoked partitions;
   (c) in A's on_partitions_assigned after rejoining, for the partitions A keeps and, apart,
       for those it lost to B (always a raw request: consumer.commit() itself refuses a
       partition not assigned, IllegalStateError);
   (d) after the rebalance (both members assigned, loop stopped).
   A raw commit's result is "accepted" or the broker's error class per partition; a
   `consumer.commit()` result is "accepted" or the exception class (with its cause).
   A's (generation, member_id) is printed at each point; B's too once assigned. A's and B's
   JoinGroup, SyncGroup and LeaveGroup requests (sent->answered, the answer's error or
   generation and member id) and their failed heartbeats are rows too, and a DescribeGroups
   poller (every 100 ms) prints the group state's changes.
3. A leaves: (e) A commits its partitions, then `consumer.stop()` (aiokafka sends LeaveGroup
   only for a dynamic member); whether A's on_partitions_revoked ran during stop; when B holds
   all 8 partitions (bounded wait); then the committed offsets and metadata read back with
   `list_consumer_group_offsets`, or, where that fails, the offsets alone with B's
   `committed()` (either way: which commit point landed last on each partition).
4. Per broker once: DescribeGroups output for a group with one dynamic and one static member,
   each a subprocess (`--member` mode of this script); then both are SIGKILLed and the group is
   described every second for 15 s: whether and when each dead member leaves the list; then a
   new dynamic member N joins and the group is described every second (25 s at most) until N
   holds partitions alone: whether a join evicts the dead members.

aiokafka 0.14's DescribeGroups goes up to v3, which carries no group_instance_id; members are
shown by member_id and client_id (A-/B-/K-static or -dynamic). It prints tables; exit code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka import errors as kerrors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.protocol.commit import OffsetCommitRequest

PARTITIONS = 8
RECORDS_PER_PARTITION = 10
# Each commit point commits its own offset (all within the log), so a read-back of offsets alone
# (tansu fails aiokafka's OffsetFetch from the admin client) still tells which point landed last.
POINT_OFFSETS = {"S": 1, "a": 2, "b": 3, "c": 4, "d": 5, "e": 6}
SESSION_TIMEOUT_MS = 6000
HEARTBEAT_MS = 500
LOOP_PERIOD_S = 0.025
SCENARIO_TIMEOUT_S = 55.0
KILL_WATCH_S = 15.0
NEWCOMER_WATCH_S = 25.0
SCENARIOS = ("static-raw", "dynamic-raw", "static-api", "dynamic-api")


@dataclass
class Row:
    section: int
    point: str
    t: str
    who: str
    result: str

    def start(self) -> float:
        return float(self.t.split("..")[0].split("->")[0] or 0)


@dataclass
class Probe:
    """One scenario's clock, state labels and result rows."""

    t0: float = 0.0
    section: int = 0
    phase: str = "steady"
    rows: list[Row] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, point: str, t: float | str, who: str, result: str) -> None:
        shown = f"{t:+.3f}" if isinstance(t, float) else t
        self.rows.append(Row(self.section, point, shown, who, result))

    def span(self, sent: float) -> str:
        """`sent->now`: a request's send and answer times."""
        return f"{sent:+.3f}->{self.now():+.3f}"

    def restart_clock(self) -> None:
        """t=0 from now; the rows after it are printed after the earlier ones."""
        self.t0 = time.monotonic()
        self.section += 1


_TRACED = {11: "JoinGroup", 14: "SyncGroup", 12: "Heartbeat", 13: "LeaveGroup"}


def trace_group_requests(consumer: AIOKafkaConsumer, who: str, probe: Probe) -> None:
    """Record `consumer`'s JoinGroup, SyncGroup and LeaveGroup requests (send -> answer) and its
    heartbeats that fail."""
    client = consumer._client
    original = client.send

    async def send(node_id: int, request: Any, **kwargs: Any) -> Any:
        name = _TRACED.get(getattr(request, "API_KEY", -1))
        if name is None:
            return await original(node_id, request, **kwargs)
        sent = probe.now()
        try:
            response = await original(node_id, request, **kwargs)
        except Exception as exc:
            probe.add(f"{who} {name}", f"{sent:+.3f}->{probe.now():+.3f}", who, describe_error(exc))
            raise
        code = getattr(response, "error_code", 0)
        if name == "Heartbeat" and code == 0:
            return response
        result = "ok" if code == 0 else kerrors.for_code(code).__name__
        if name == "JoinGroup" and code == 0:
            result += f" gen={response.generation_id} member={response.member_id}"
        probe.add(f"{who} {name}", f"{sent:+.3f}->{probe.now():+.3f}", who, result)
        return response

    client.send = send


def ident(consumer: AIOKafkaConsumer) -> str:
    coordinator = consumer._coordinator
    return f"gen={coordinator.generation} member={coordinator.member_id}"


def describe_error(exc: BaseException) -> str:
    name = type(exc).__name__
    cause = exc.__cause__
    return f"{name} (cause {type(cause).__name__})" if cause is not None else name


async def raw_commit(
    consumer: AIOKafkaConsumer, group: str, offsets: dict[TopicPartition, tuple[int, str]]
) -> tuple[str, str]:
    """Send one OffsetCommit with A's generation and member id; (ident, result) without touching
    the coordinator's state (aiokafka's own commit resets the generation on some errors)."""
    coordinator = consumer._coordinator
    sent_as = ident(consumer)
    if not offsets:
        return sent_as, "nothing to commit"
    by_topic: dict[str, list[tuple[int, int, str]]] = {}
    for tp, (offset, metadata) in sorted(offsets.items()):
        by_topic.setdefault(tp.topic, []).append((tp.partition, offset, metadata))
    request = OffsetCommitRequest(
        group,
        coordinator.generation,
        coordinator.member_id,
        OffsetCommitRequest.DEFAULT_RETENTION_TIME,
        list(by_topic.items()),
    )
    node = coordinator.coordinator_id
    if node is None:
        return sent_as, "no coordinator known"
    try:
        response = await consumer._client.send(node, request)
    except kerrors.KafkaError as exc:
        return sent_as, f"request failed: {describe_error(exc)}"
    by_error: dict[str, list[int]] = {}
    for _topic, partitions in response.topics:
        for partition, code in partitions:
            error = kerrors.for_code(code)
            name = "accepted" if error is kerrors.NoError else error.__name__
            by_error.setdefault(name, []).append(partition)
    if len(by_error) == 1:
        return sent_as, next(iter(by_error))
    return sent_as, "; ".join(f"{name} p{sorted(ps)}" for name, ps in sorted(by_error.items()))


async def api_commit(
    consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, tuple[int, str]]
) -> tuple[str, str]:
    sent_as = ident(consumer)
    if not offsets:
        return sent_as, "nothing to commit"
    try:
        async with asyncio.timeout(10):
            await consumer.commit(offsets)
    except (kerrors.KafkaError, TimeoutError) as exc:
        return sent_as, describe_error(exc)
    return sent_as, "accepted"


def offsets_for(tps: set[TopicPartition], tag: str) -> dict[TopicPartition, tuple[int, str]]:
    offset = POINT_OFFSETS[tag[0]]
    return {tp: (offset, tag) for tp in tps}


def parts(tps: set[TopicPartition]) -> str:
    return "p" + ",".join(str(tp.partition) for tp in sorted(tps)) if tps else "none"


class AListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """A's listener: commits at (b) and (c) and moves the phase labels."""

    def __init__(self, probe: Probe, group: str, use_api: bool) -> None:
        self.probe = probe
        self.group = group
        self.use_api = use_api
        self.consumer: AIOKafkaConsumer | None = None
        self.assigned: set[TopicPartition] = set()
        self.assignments = 0
        self.reassigned = asyncio.Event()
        self.revoked_calls = 0
        self.stopping = False

    async def commit(self, offsets: dict[TopicPartition, tuple[int, str]]) -> tuple[str, str]:
        if self.consumer is None:
            raise RuntimeError("set the listener's consumer first")
        if self.use_api:
            return await api_commit(self.consumer, offsets)
        return await raw_commit(self.consumer, self.group, offsets)

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.revoked_calls += 1
        if self.assignments == 0:
            return
        probe = self.probe
        label = "(e') revoke during stop" if self.stopping else "(b) in on_partitions_revoked"
        probe.phase = "in-revoke"
        t = probe.now()
        sent_as, result = await self.commit(offsets_for(set(revoked), "b-revoke"))
        probe.add(label, probe.span(t), f"A {sent_as}", f"{parts(set(revoked))}: {result}")
        probe.phase = "rejoining"

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.assignments += 1
        before, self.assigned = self.assigned, set(assigned)
        if self.assignments == 1 or self.consumer is None:
            return
        probe = self.probe
        probe.phase = "post-assign"
        t = probe.now()
        probe.add("A assigned again", t, f"A {ident(self.consumer)}", parts(self.assigned))
        kept, lost = before & self.assigned, before - self.assigned
        t = probe.now()
        sent_as, result = await self.commit(offsets_for(kept, "c-kept"))
        probe.add("(c) assigned: kept", probe.span(t), f"A {sent_as}", f"{parts(kept)}: {result}")
        t = probe.now()
        # consumer.commit() refuses an unassigned partition itself (IllegalStateError), so the
        # broker's answer for a lost partition comes from a raw request in both variants.
        sent_as, result = await raw_commit(self.consumer, self.group, offsets_for(lost, "c-lost"))
        probe.add(
            "(c) assigned: lost (raw)", probe.span(t), f"A {sent_as}", f"{parts(lost)}: {result}"
        )
        self.reassigned.set()


class BListener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.assigned: set[TopicPartition] = set()
        self.changed = asyncio.Event()
        self.first_at: float | None = None

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.assigned = set(assigned)
        self.changed.set()


def make_consumer(
    bootstrap: str,
    topic: str,
    *,
    group: str,
    name: str,
    static: bool,
    listener: ConsumerRebalanceListener,
) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        client_id=f"{name}-static" if static else f"{name}-dynamic",
        group_instance_id=f"{group}-{name}" if static else None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=SESSION_TIMEOUT_MS,
        heartbeat_interval_ms=HEARTBEAT_MS,
        retry_backoff_ms=100,
    )
    consumer.subscribe([topic], listener=listener)
    return consumer


async def keep_polling(consumer: AIOKafkaConsumer) -> None:
    """What a worker's loop does: getmany() all the time, so aiokafka rejoins promptly."""
    while True:
        try:
            await consumer.getmany(timeout_ms=100)
        except kerrors.KafkaError:
            await asyncio.sleep(0.1)


async def wait_for(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(step_s)
    return True


async def describe(admin: AIOKafkaAdminClient, group: str) -> tuple[str, list[tuple[str, str]]]:
    """(state, [(member_id, client_id)]) of `group`, or ("error: ...", [])."""
    try:
        async with asyncio.timeout(5):
            responses = await admin.describe_consumer_groups([group])
    except (kerrors.KafkaError, TimeoutError, ValueError, AssertionError) as exc:
        return f"error: {describe_error(exc)}: {exc}", []
    for response in responses:
        for entry in response.groups:
            error_code, _group, state, _ptype, _protocol, members = entry[:6]
            if error_code != 0:
                return f"error: {kerrors.for_code(error_code).__name__}", []
            return state, [(member[0], member[1]) for member in members]
    return "error: empty response", []


async def watch_group(
    admin: AIOKafkaAdminClient, group: str, probe: Probe, stop: asyncio.Event
) -> None:
    last: tuple[str, int] | None = None
    while not stop.is_set():
        t = probe.now()
        state, members = await describe(admin, group)
        if (state, len(members)) != last:
            last = (state, len(members))
            probe.add("group (DescribeGroups)", t, "-", f"state={state} members={len(members)}")
        await asyncio.sleep(0.1)


async def commit_loop(
    consumer: AIOKafkaConsumer,
    group: str,
    tps: set[TopicPartition],
    probe: Probe,
    stop: asyncio.Event,
) -> None:
    """(a): raw commits every 25 ms; rows are runs of equal (phase, ident, result)."""
    # [phase, sent_as, result, first sent, first answered, last sent, count]
    run: list[Any] | None = None
    n = 0

    def flush() -> None:
        if run is not None:
            phase, sent_as, result, first, answered, last, count = run
            probe.add(
                f"(a) loop, {phase}",
                f"{first:+.3f}..{last:+.3f}",
                f"A {sent_as}",
                f"{result} x{count} (first answered {answered:+.3f})",
            )

    while not stop.is_set():
        n += 1
        phase = probe.phase
        t = probe.now()
        sent_as, result = await raw_commit(consumer, group, offsets_for(tps, f"a-loop-{n}"))
        answered = probe.now()
        key = (phase, sent_as, result)
        if run is not None and tuple(run[:3]) == key:
            run[5] = t
            run[6] += 1
        else:
            flush()
            run = [phase, sent_as, result, t, answered, t, 1]
        await asyncio.sleep(LOOP_PERIOD_S)
    flush()


async def create_topic(bootstrap: str, prefix: str) -> str:
    topic = f"{prefix}-{uuid.uuid4().hex[:10]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=False, acks=1)
    await producer.start()
    try:
        for _attempt in range(50):  # the new topic's metadata may take a moment
            with contextlib.suppress(kerrors.KafkaError):
                if len(await producer.partitions_for(topic) or ()) == PARTITIONS:
                    break
            await asyncio.sleep(0.1)
        for partition in range(PARTITIONS):
            for i in range(RECORDS_PER_PARTITION):
                await producer.send_and_wait(topic, f"r{i}".encode(), partition=partition)
    finally:
        await producer.stop()
    return topic


async def leave(
    probe: Probe,
    a: AIOKafkaConsumer,
    a_listener: AListener,
    b: AIOKafkaConsumer,
    b_listener: BListener,
    *,
    poller: asyncio.Task[None],
) -> None:
    """(e): A's final commit, A's stop, and how long until B holds every partition."""
    t = probe.now()
    sent_as, result = await a_listener.commit(offsets_for(a_listener.assigned, "e-final"))
    probe.add(
        "(e) final commit, then stop",
        probe.span(t),
        f"A {sent_as}",
        f"{parts(a_listener.assigned)}: {result}",
    )
    a_listener.stopping = True
    calls_before = a_listener.revoked_calls
    poller.cancel()
    t = probe.now()
    try:
        async with asyncio.timeout(15):
            await a.stop()
    except TimeoutError:
        probe.add("A stop()", t, "A", "did not return in 15 s")
    probe.add(
        "A stop() returned",
        t,
        "A",
        f"{probe.now() - t:.3f} s; revoke callback ran during stop: "
        f"{a_listener.revoked_calls > calls_before}",
    )
    t_stop = probe.now()
    if await wait_for(lambda: len(b_listener.assigned) == PARTITIONS, 15):
        probe.add(
            "B holds all 8",
            probe.now(),
            f"B {ident(b)}",
            f"{probe.now() - t_stop:.3f} s after A's stop",
        )
    else:
        probe.add(
            "B holds all 8",
            probe.now(),
            f"B {ident(b)}",
            f"not within 15 s; B has {parts(b_listener.assigned)}",
        )


async def read_back(
    probe: Probe, admin: AIOKafkaAdminClient, group: str, b: AIOKafkaConsumer
) -> None:
    """Which commit point's offset (and metadata) each partition holds at the end."""
    by_meta: dict[str, list[int]] = {}
    try:
        async with asyncio.timeout(5):
            committed = await admin.list_consumer_group_offsets(group)
        for tp, meta in committed.items():
            by_meta.setdefault(f"{meta.offset}/{meta.metadata}", []).append(tp.partition)
        who = "admin list_consumer_group_offsets"
    except (kerrors.KafkaError, TimeoutError) as exc:
        who = f"B committed() (admin failed: {type(exc).__name__})"
        names = {offset: point for point, offset in POINT_OFFSETS.items()}
        for tp in sorted(b.assignment()):
            offset = await b.committed(tp)
            by_meta.setdefault(f"{offset}/{names.get(offset, '?')}", []).append(tp.partition)
    probe.add(
        "read back (offset/metadata)",
        probe.now(),
        who,
        "; ".join(f"{key} p{sorted(ps)}" for key, ps in sorted(by_meta.items())),
    )


async def scenario(bootstrap: str, name: str, probe: Probe) -> None:  # noqa: PLR0915 - the steps
    static = name.startswith("static")
    use_api = name.endswith("api")
    topic = await create_topic(bootstrap, "probe")
    group = f"probe-{name}-{uuid.uuid4().hex[:6]}"
    a_listener = AListener(probe, group, use_api)
    a = make_consumer(bootstrap, topic, group=group, name="A", static=static, listener=a_listener)
    a_listener.consumer = a
    b_listener = BListener()
    b = make_consumer(bootstrap, topic, group=group, name="B", static=static, listener=b_listener)
    trace_group_requests(a, "A", probe)
    trace_group_requests(b, "B", probe)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    tasks: list[asyncio.Task[None]] = []
    stop_loop, stop_watch = asyncio.Event(), asyncio.Event()
    started: list[AIOKafkaConsumer] = []
    try:
        await admin.start()
        await a.start()
        started.append(a)
        tasks.append(asyncio.create_task(keep_polling(a)))
        if not await wait_for(lambda: len(a_listener.assigned) == PARTITIONS, 30):
            probe.add("A alone", probe.now(), f"A {ident(a)}", "no assignment in 30 s: gave up")
            return
        await asyncio.sleep(0.5)  # a fetch or two
        probe.add("A alone assigned", probe.now(), f"A {ident(a)}", parts(a_listener.assigned))
        t = probe.now()
        sent_as, result = await a_listener.commit(offsets_for(a_listener.assigned, "S-steady"))
        probe.add("(S) steady commit", probe.span(t), f"A {sent_as}", result)
        # B's join starts: t=0 from here on.
        probe.restart_clock()
        probe.phase = "pre-revoke"
        tasks.append(asyncio.create_task(watch_group(admin, group, probe, stop_watch)))
        tasks.append(
            asyncio.create_task(commit_loop(a, group, set(a_listener.assigned), probe, stop_loop))
        )
        await b.start()
        started.append(b)
        tasks.append(asyncio.create_task(keep_polling(b)))
        done = await wait_for(
            lambda: bool(b_listener.assigned) and a_listener.reassigned.is_set(), 20
        )
        if b_listener.assigned:
            probe.add("B assigned", probe.now(), f"B {ident(b)}", parts(b_listener.assigned))
        if not done:
            probe.add("rebalance", probe.now(), f"A {ident(a)}", "not complete in 20 s")
        await asyncio.sleep(1.0)
        stop_loop.set()
        await asyncio.sleep(0.1)
        t = probe.now()
        sent_as, result = await a_listener.commit(offsets_for(a_listener.assigned, "d-after"))
        probe.add(
            "(d) after rebalance",
            probe.span(t),
            f"A {sent_as}",
            f"{parts(a_listener.assigned)}: {result}",
        )
        # (e) the leave.
        await leave(probe, a, a_listener, b, b_listener, poller=tasks[0])
        started.remove(a)
        stop_watch.set()
        await read_back(probe, admin, group, b)
    finally:
        stop_loop.set()
        stop_watch.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for consumer in started:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await consumer.stop()
        with contextlib.suppress(Exception):
            await admin.close()


async def read_line(stream: asyncio.StreamReader, timeout_s: float) -> str:
    async with asyncio.timeout(timeout_s):
        return (await stream.readline()).decode().strip()


async def kill_probe(bootstrap: str, probe: Probe) -> None:
    """Step 4: DescribeGroups with a live dynamic and a live static member, then after kill -9."""
    topic = await create_topic(bootstrap, "probe-kill")
    group = f"probe-kill-{uuid.uuid4().hex[:6]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    await admin.start()
    procs: list[asyncio.subprocess.Process] = []
    try:
        for kind in ("dynamic", "static"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--member",
                bootstrap,
                topic,
                group,
                kind,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            procs.append(proc)
            try:
                line = await read_line(proc.stdout, 40) if proc.stdout else "no stdout"
            except TimeoutError:
                line = "no line in 40 s"
            probe.add(f"{kind} member subprocess", probe.now(), f"pid {proc.pid}", line)
        await asyncio.sleep(1.0)
        state, members = await describe(admin, group)
        probe.add("describe, both alive", probe.now(), "-", f"state={state}")
        for member_id, client_id in members:
            probe.add("  member", probe.now(), f"client_id={client_id}", f"member_id={member_id}")
        probe.restart_clock()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        for proc in procs:
            await proc.wait()
        probe.add("both SIGKILLed (t=0)", 0.0, "-", "")
        last: tuple[str, tuple[str, ...]] | None = None
        deadline = time.monotonic() + KILL_WATCH_S
        while time.monotonic() < deadline:
            t = probe.now()
            state, members = await describe(admin, group)
            key = (state, tuple(sorted(member_id[:24] for member_id, _c in members)))
            if key != last:
                last = key
                probe.add("describe after kill", t, "-", f"state={state} members={list(key[1])}")
            await asyncio.sleep(1.0)
        probe.add("describe watch ended", probe.now(), "-", f"last: {last}")
        await newcomer(bootstrap, topic, group, admin, probe)
    finally:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        await admin.close()


async def newcomer(
    bootstrap: str, topic: str, group: str, admin: AIOKafkaAdminClient, probe: Probe
) -> None:
    """A new dynamic member N joins the group of dead members; DescribeGroups every second until
    N holds partitions and the list settles, for NEWCOMER_WATCH_S at most."""
    listener = BListener()
    consumer = make_consumer(
        bootstrap, topic, group=group, name="N", static=False, listener=listener
    )
    trace_group_requests(consumer, "N", probe)
    probe.add("new member N starts", probe.now(), "-", "")
    last: tuple[str, tuple[str, ...]] | None = None
    deadline = time.monotonic() + NEWCOMER_WATCH_S

    async def run() -> None:
        t = probe.now()
        await consumer.start()
        probe.add("N start() returned", probe.span(t), "N", "")
        await keep_polling(consumer)

    poll = asyncio.create_task(run())
    try:
        while time.monotonic() < deadline:
            t = probe.now()
            state, members = await describe(admin, group)
            key = (state, tuple(sorted(member_id[:24] for member_id, _c in members)))
            if key != last:
                last = key
                probe.add("describe with N", t, "-", f"state={state} members={list(key[1])}")
            if listener.assigned and len(members) == 1:
                break
            await asyncio.sleep(1.0)
        probe.add(
            "N's assignment",
            probe.now(),
            f"N {ident(consumer)}",
            parts(listener.assigned) if listener.assigned else "none",
        )
    finally:
        poll.cancel()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await consumer.stop()


async def member_main(bootstrap: str, topic: str, group: str, kind: str) -> None:
    """`--member`: join, print the member id once assigned, then wait to be killed (max 120 s)."""
    listener = BListener()
    consumer = make_consumer(
        bootstrap, topic, group=group, name="K", static=kind == "static", listener=listener
    )
    await consumer.start()
    poll = asyncio.create_task(keep_polling(consumer))
    try:
        async with asyncio.timeout(40):
            await listener.changed.wait()
        print(f"assigned {parts(listener.assigned)} {ident(consumer)}", flush=True)
        await asyncio.sleep(120)
    finally:
        poll.cancel()
        await consumer.stop()


def print_table(title: str, probe: Probe) -> None:
    print(f"\n== {title}")
    widths = [
        max([len(h), *(len(getattr(r, h)) for r in probe.rows)]) for h in ("point", "t", "who")
    ]
    header = ("point", "t (s)", "who")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + "  result")
    for row in sorted(probe.rows, key=lambda r: (r.section, r.start())):
        cells = (row.point, row.t, row.who)
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + "  " + row.result)


async def run_broker(kind: str, scenarios: list[str]) -> None:
    from worker.dev.broker import LocalBroker, TansuBroker  # noqa: PLC0415 - only to start them

    broker = LocalBroker() if kind == "noida" else TansuBroker()
    started = time.monotonic()
    await asyncio.to_thread(broker.start)
    try:
        for name in scenarios:
            probe = Probe(t0=time.monotonic())
            try:
                async with asyncio.timeout(SCENARIO_TIMEOUT_S):
                    await scenario(broker.bootstrap_servers, name, probe)
            except TimeoutError:
                probe.add("SCENARIO TIMEOUT", probe.now(), "-", f"{SCENARIO_TIMEOUT_S} s in all")
            print_table(f"{kind}: scenario {name}", probe)
        probe = Probe(t0=time.monotonic())
        try:
            async with asyncio.timeout(KILL_WATCH_S + NEWCOMER_WATCH_S + 60):
                await kill_probe(broker.bootstrap_servers, probe)
        except TimeoutError:
            probe.add("KILL PROBE TIMEOUT", probe.now(), "-", "")
        print_table(f"{kind}: DescribeGroups, live and SIGKILLed members", probe)
    finally:
        await asyncio.to_thread(broker.stop)
    print(f"\n({kind}: {time.monotonic() - started:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=("noida", "tansu", "both"), default="both")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="default: all")
    parser.add_argument("--kill-only", action="store_true", help="only step 4")
    parser.add_argument("--member", nargs=4, metavar=("BOOTSTRAP", "TOPIC", "GROUP", "KIND"))
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("PROBE_LOG", "CRITICAL"))
    if args.member:
        asyncio.run(member_main(*args.member))
        return
    brokers = ("noida", "tansu") if args.broker == "both" else (args.broker,)
    for kind in brokers:
        asyncio.run(run_broker(kind, [] if args.kill_only else args.scenario or list(SCENARIOS)))


if __name__ == "__main__":
    main()
