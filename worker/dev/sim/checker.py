"""The checker: judges a run's history and the topics' final contents, knowing nothing of the
worker's implementation (as Jepsen's Kafka checker judges sends and polls).

Invariants (each violation names one):

- `unanswered`: every valid job has an answer (completed, or failed with its code) by the end,
  which comes `settle_s` after the last fault or process death (a job that kills the engine
  goes on killing after the faults end, up to the breaker's limit), at most three settle
  periods after the faults;
- `wrongly_dead_lettered`: nothing is dead-lettered or answered as crash-looped unless it kills
  the process or is invalid input;
- `stalled`: after the faults, no partition with work stays without a commit advance for longer
  than `progress_bound_s`;
- `commit_backwards`: a committed position never moves backwards;
- `duplicates`: each answer of a job after its first has a cause between the two, as the
  README's delivery semantics give them (`_Causes`): a death of the first answer's process (a
  kill, an exit, the group removing it while it lived, a missed poll interval), a hand-over
  of the job's partition the group refused, or an outage in which no commit could land, each
  while no landed commit covered the job; an acknowledgement lost (or, without an idempotent
  producer, late); the trainer sending the job again; a landed map its worker declared had
  left its answered section out to fit its cap (`map_degraded`), for the records it left out
  (plain at-least-once for those, the docs say). A job a clean hand-over names as
  running, its answer handed to the producer before the hand-over and appended after the
  rebalance began, is the next owner's to run, and may be answered twice when the old
  owner's delivery lands after all (sent again after the hand-over, it may not). Nothing
  else answers a job twice: not a clean hand-over, a rebalance or an adoption;
- `wrong_weights`: a completed result carries the weight version of the generation that made
  it (the simulated engine records each, `worker.dev.sim.paths`), not the version served
  when the job started or when its answer was sent;
- `suspect_not_alone`: a record the landed map names in flight at two deaths or more runs
  with nothing else generating in its worker but suspects of as many (`_QUIET_FROM`);
- `unasked_exit`: no worker exits except when told to stop, and then with status 0;
- `state_unbounded`: the state a partition keeps at the broker (its offset map) stays within
  `--offset-map-max-bytes`;
- `wrongly_blamed`: a record's death count (the crash-loop breaker's, in the offset map the
  group stores) never exceeds the process kills between its append and that commit, plus the
  times the group removed a live owner of its partition for a missed session or rebalance
  timeout: a death that was not a kill (a clean stop, an update that killed the engine)
  blames nothing, and a member the coordinator removed is dead to the group (its hand-over
  can no longer land, and the next owner cannot tell it from a kill), as is a process that
  stopped with no way to land its hand-over (no generation for its member since its last
  landed commit, and at its exit the coordinator away or the group rebalancing);
- `weights_diverged`: every live worker serves, at the end, the weights of the last update, in
  control-topic order, that any worker acknowledged applying (read from the status topic's
  acknowledgements, a forced rollback's too; a worker's served version is what its status
  reports).

One broker property excuses `unanswered` and `stalled`, and only where it is seen: on a broker
that evicts no member (noida-db, `Flavour.NOIDA`), a static member scaled in that could not
leave, the coordinator away until the end of its whole leave budget (what its grace left and
half of `--close-timeout-s`), is waited for by every rebalance after, for ever; Apache Kafka
removes it at the rebalance timeout. The run is excused only when such an exit came, a
rebalance began after it and no generation ever ended it (`wedged_from`). A member that gave
up leaving before its budget ran out, left as the wrong member, or was left behind by a
rejoin (seeds 403, 71294, 77174, 99100) is flagged as before.
"""

from __future__ import annotations

import bisect
import enum
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from schemas import CommandAck, Completed, Failed, SchemaError, decode_result, decode_status
from worker.delivery.offset_map import OffsetMap, OffsetMapError, decode_offset_map
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.fleet import KILLS_ENGINE
from worker.dev.sim.history import Event, History

__all__ = ["Bounds", "Kind", "Ledger", "Violation", "check", "ok_update_acks", "wedged_from"]


class Kind(enum.Enum):
    """What the trainer meant a record to be."""

    VALID = "valid"
    #: A valid job about as long as a revoke's grace: a rebalance finds it running.
    SLOW = "slow"
    LONG = "long"
    INVALID = "invalid"
    CRASH = "crash"
    REPLY_SMALL = "reply_small"
    REPLY_LOCKED = "reply_locked"

    @property
    def must_answer(self) -> bool:
        return self is not Kind.INVALID

    @property
    def may_dead_letter(self) -> bool:
        return self in (Kind.INVALID, Kind.CRASH)


@dataclass
class Ledger:
    """The trainer's own record of what it produced: source (topic-partition, offset) -> kind
    and job id."""

    records: dict[tuple[str, int], tuple[Kind, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Bounds:
    faults_end: float
    end: float
    progress_bound_s: float
    max_in_flight: int
    offset_map_max_bytes: int
    answer_topics: tuple[str, ...]
    dead_letter_topic: str
    jobs_topic: str
    status_topic: str
    #: The group evicts no member (noida-db): see `wedged_from`.
    never_evicts: bool = False
    #: The longest a stopping worker tries to leave, from its SIGTERM on: its shutdown grace
    #: and half of its close timeout.
    leave_budget_s: float = 0.0
    #: The workers' producers are idempotent: a batch retried after a slow acknowledgement is
    #: not appended twice (tansu has no idempotent producer).
    idempotent: bool = True
    #: The workers' `--max-crash-attempts`: the deaths a record that kills the process costs.
    max_crash_attempts: int = 5
    #: The serving weights are judged against the trainer's last update elsewhere
    #: (`worker.dev.sim.control_checks`): a rollback leaves the fleet below the highest
    #: version it applied.
    weights_judged_elsewhere: bool = False


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str
    at: float

    def __str__(self) -> str:
        return f"[{self.invariant}] at {self.at:.3f}s: {self.detail}"


def check(history: History, cluster: Cluster, ledger: Ledger, bounds: Bounds) -> list[Violation]:
    answers, sent, crash_looped = _read_answers(cluster, bounds)
    kinds = {job_id: kind for (kind, job_id) in ledger.records.values()}
    # Liveness, unless a broker that evicts nobody waits for a member for ever.
    live = wedged_from(history, bounds) is None
    violations = _unanswered(ledger, answers, bounds) if live else []
    for job_id in crash_looped:
        looped = kinds.get(job_id)
        if looped is not None and not looped.may_dead_letter:
            violations.append(
                Violation(
                    "wrongly_dead_lettered",
                    f"job {job_id} ({looped.value}) answered as crash-looped",
                    bounds.end,
                )
            )
    dlq = cluster.topics.get(bounds.dead_letter_topic)
    for log in dlq.logs if dlq is not None else []:
        for record in log:
            headers = dict(record.headers)
            source = (
                f"{headers.get('vkw.source.topic', b'').decode()}-"
                f"{headers.get('vkw.source.partition', b'').decode()}",
                int(headers.get("vkw.source.offset", b"-1")),
            )
            entry = ledger.records.get(source)
            if entry is not None and not entry[0].may_dead_letter:
                violations.append(
                    Violation(
                        "wrongly_dead_lettered",
                        f"{source[0]}@{source[1]} ({entry[0].value}, job {entry[1]}) "
                        f"dead-lettered: {headers.get('vkw.error.detail', b'').decode()}",
                        record.timestamp_ms / 1000,
                    )
                )
    maps = list(_committed_maps(history, bounds))
    handed_over = _handed_over_in_flight(history, ledger, maps, sent)
    violations += _duplicates(history, ledger, maps, sent, handed_over, bounds)
    violations += _stamps(history, sent)
    violations += _suspects_not_alone(history, ledger, maps)
    violations += _commits_and_exits(history)
    violations += _blame(history, cluster, ledger, bounds, maps)
    applied = (
        None if bounds.weights_judged_elsewhere else _latest_applied(cluster, bounds.status_topic)
    )
    for event in history.of("serving"):
        if applied is not None and event.fields["weight_version"] != applied:
            violations.append(
                Violation(
                    "weights_diverged",
                    f"{event.fields['worker']} serves weights {event.fields['weight_version']}; "
                    f"the fleet applied {applied}",
                    bounds.end,
                )
            )
    return violations + (_stalled(history, bounds, maps) if live else [])


def _unanswered(ledger: Ledger, answers: Counter[str], bounds: Bounds) -> list[Violation]:
    return [
        Violation("unanswered", f"job {job_id} ({kind.value}) never answered", bounds.end)
        for (_, _), (kind, job_id) in sorted(ledger.records.items())
        if kind.must_answer and not answers[job_id]
    ]


def _stalled(
    history: History, bounds: Bounds, maps: list[tuple[Event, str, OffsetMap]]
) -> list[Violation]:
    """The first partition, after the faults, without a commit for longer than the bound.

    `progress_bound_s` bounds the wait of a partition whose owner is up and runs what it
    fetches. The crash-loop breaker's documented costs come on top of it (README, "Jobs that
    kill the worker"; worker/loop/breaker.py): a record that kills the process is answered
    only at `--max-crash-attempts` deaths, each of which leaves every partition of its owner
    unserved until the restarted process has joined again (a restart takes 1 s to 5 s here,
    `worker.dev.sim.fleet`); and what was in flight beside it at its first three deaths then
    runs one job at a time with nothing else beside it, a long rollout's whole length each
    (`long_tokens` * `per_token_ms`: 20 s). Neither is counted against the partition
    (`_BreakerTime`). Seed 800109 of `_hostile_with_updates` (five workers): three long
    rollouts, in flight at a killer's first three deaths, ran alone one after another, and the
    killer's partition waited 70 s for its turn. Seed 810057 (`--flavour noida --static`, one
    worker left): seven killer records on one worker took 35 deaths, and a partition the short
    lives between them never reached waited 100 s."""
    breaker = _BreakerTime(maps, bounds.max_crash_attempts)
    owner: dict[str, str] = {}
    for event in history.events:
        breaker.see(event)
        fields = event.fields
        if event.kind == "joined":
            owner.update(dict.fromkeys(fields["tps"], _worker(fields["process"])))
        if event.kind != "stall" or event.at < bounds.faults_end:
            continue
        waited = fields["for_s"]
        if (worker := owner.get(fields["tp"])) is not None:
            waited -= breaker.spent(worker, event.at - fields["for_s"], event.at)
        if waited > bounds.progress_bound_s:
            return [
                Violation(
                    "stalled",
                    f"{fields['tp']} without a commit for {fields['for_s']:.1f}s "
                    f"(committed {fields['committed']}, end {fields['end']})",
                    event.at,
                )
            ]
    return []


class _BreakerTime:
    """Per worker (its id, across restarts), the spans its partitions waited on the crash-loop
    breaker's documented costs, read event by event: from each of the first
    `max_crash_attempts` deaths a job caused to the worker's next join, and the finished runs
    of suspects of three deaths or more. Suspects of two deaths run together once, a drain and
    the longest of them, within the bound; a run cut short (a rebalance) is time lost, not the
    breaker's."""

    def __init__(self, maps: list[tuple[Event, str, OffsetMap]], max_crash_attempts: int) -> None:
        self._by_map = {id(event): offset_map.deaths for event, _, offset_map in maps}
        self._max_crash_attempts = max_crash_attempts
        self._deaths_now: dict[str, Mapping[int, int]] = {}
        self._killed: Counter[str] = Counter()
        self._spans: dict[str, list[tuple[float, float]]] = {}
        self._dead_since: dict[str, float] = {}
        self._alone_since: dict[tuple[str, str], float] = {}
        # Runs alone that ended, until their generation is known to have finished.
        self._ended: dict[tuple[str, str], tuple[float, float]] = {}

    def see(self, event: Event) -> None:
        fields = event.fields
        key = (fields.get("worker", ""), fields.get("job", ""))
        if event.kind == "commit" and id(event) in self._by_map:
            self._deaths_now[fields["tp"]] = self._by_map[id(event)]
        elif event.kind == "joined":
            worker = _worker(fields["process"])
            if (died := self._dead_since.pop(worker, None)) is not None:
                self._spans.setdefault(worker, []).append((died, event.at))
        elif event.kind == "kill" and (killer := _killer(fields.get("why"))) is not None:
            self._killed[killer] += 1
            if self._killed[killer] <= self._max_crash_attempts:
                self._dead_since.setdefault(_worker(fields["worker"]), event.at)
        elif event.kind == "generating":
            source = _place(fields.get("record"))
            if source and self._deaths_now.get(source[0], {}).get(source[1], 0) >= _ALONE_FROM:
                self._alone_since[key] = event.at
        elif event.kind == "generation_over" and key in self._alone_since:
            self._ended[key] = (self._alone_since.pop(key), event.at)
        elif event.kind == "generated" and key in self._ended:
            self._spans.setdefault(_worker(key[0]), []).append(self._ended.pop(key))

    def spent(self, worker: str, since: float, until: float) -> float:
        """How long, between `since` and `until`, `worker` spent on the breaker's costs."""
        spans = list(self._spans.get(worker, []))
        if (died := self._dead_since.get(worker)) is not None:
            spans.append((died, until))
        spans += [(at, until) for (p, _), at in self._alone_since.items() if _worker(p) == worker]
        total, reached = 0.0, since
        for began, ended in sorted(spans):
            begin, end = max(began, reached), min(ended, until)
            if end > begin:
                total += end - begin
                reached = end
        return total


#: Deaths from which the crash-loop breaker runs a suspect alone (`worker.loop.breaker`).
_ALONE_FROM = 3


def _killer(why: object) -> str | None:
    """The job a kill names as having crashed the engine (`worker.dev.sim.fleet`)."""
    words = str(why or "").split()
    return words[1] if words[:1] == ["job"] and words[2:] == ["crashes", "the", "engine"] else None


def _worker(process: str) -> str:
    """The worker a process (`w1#3`) is a life of (`w1`)."""
    return process.split("#", 1)[0]


#: How much earlier than its leave budget a worker may give up leaving: it tries again every
#: half second (`worker.core.kafka._LEAVE_RETRY_S`) and stops when the next try would be late.
_LEAVE_TRY_S = 0.5


def wedged_from(history: History, bounds: Bounds) -> float | None:
    """When the group began a rebalance that never ended because a member that could not leave
    is waited for, on a broker that evicts no member; None when it did not (see the module's
    docstring). The member's process exited asked to stop, the coordinator away at its exit,
    no earlier than its leave budget after the SIGTERM."""
    if not bounds.never_evicts:
        return None
    asked: dict[str, float] = {}
    could_not_leave = rebalancing = False
    waits_from: float | None = None
    for event in history.events:
        fields = event.fields
        if event.kind == "sigterm":
            asked.setdefault(fields["worker"], event.at)
        elif event.kind == "exit" and fields.get("coordinator_away") and fields["asked"]:
            sigterm = asked.get(fields["worker"])
            if sigterm is not None and event.at >= sigterm + bounds.leave_budget_s - _LEAVE_TRY_S:
                could_not_leave = True
                if rebalancing and waits_from is None:
                    waits_from = event.at  # the round under way waits for it
        elif event.kind == "rebalance":
            rebalancing = True
            if could_not_leave and waits_from is None:
                waits_from = event.at
        elif event.kind == "generation":
            # A round ended: a member that had not left was no longer waited for.
            could_not_leave = rebalancing = False
            waits_from = None
    return waits_from


def ok_update_acks(cluster: Cluster, status_topic: str) -> Iterator[tuple[float, CommandAck]]:
    """Each acknowledgement `ok` of an update on the status topic, with when it was appended."""
    topic = cluster.topics.get(status_topic)
    for log in topic.logs if topic is not None else []:
        for record in log:
            try:
                message = decode_status(record.value or b"")
            except SchemaError:
                continue
            if (
                isinstance(message, CommandAck)
                and message.kind == "update_weights"
                and message.outcome == "ok"
            ):
                yield record.timestamp_ms / 1000, message


def _latest_applied(cluster: Cluster, status_topic: str) -> int | None:
    """The weight version of the last update in the control topic that a worker acknowledged
    applying (`ok` update_weights): not the highest, since a forced rollback that came later
    puts the fleet below it (the trainer flag set's loop sends them)."""
    latest: tuple[int, int] | None = None
    for _, ack in ok_update_acks(cluster, status_topic):
        order = -1 if ack.offset is None else ack.offset
        latest = max(latest or (order, 0), (order, ack.weight_version))
    return None if latest is None else latest[1]


def _commits_and_exits(history: History) -> list[Violation]:
    """`commit_backwards`, `state_unbounded` (from the commits the group took) and
    `unasked_exit`."""
    violations: list[Violation] = []
    for event in history.of("commit"):
        previous = event.fields["previous"]
        if previous is not None and event.fields["offset"] < previous:
            violations.append(
                Violation(
                    "commit_backwards",
                    f"{event.fields['tp']} committed {event.fields['offset']} after {previous} "
                    f"(by {event.fields['client']})",
                    event.at,
                )
            )
        if event.fields["metadata_bytes"] > _map_cap(history):
            violations.append(
                Violation(
                    "state_unbounded",
                    f"{event.fields['tp']}: {event.fields['metadata_bytes']}-byte offset map",
                    event.at,
                )
            )
    killing = [
        e.fields["checkpoint"]
        for e in history.of("weight_update")
        if KILLS_ENGINE in e.fields["checkpoint"]
    ]
    for event in history.of("exit"):
        fatal = event.fields.get("fatal") or ""
        if any(name in fatal for name in killing):
            continue  # the injected fault itself: an update whose load kills the engine
        if not event.fields["asked"] or event.fields["status"] != 0:
            violations.append(
                Violation(
                    "unasked_exit",
                    f"{event.fields['worker']} exited with {event.fields['status']} "
                    f"({'asked' if event.fields['asked'] else 'not asked'} to stop): "
                    f"{event.fields.get('fatal')}",
                    event.at,
                )
            )
    return violations


def _map_cap(history: History) -> int:
    """--offset-map-max-bytes, as the scenario event records it."""
    scenario = next(history.of("scenario"), None)
    return int(scenario.fields["offset_map_max_bytes"]) if scenario is not None else 1 << 30


class _Sent(NamedTuple):
    """One answer record: who produced it, when it was handed to the producer, when appended,
    and the weight version it carries (None: not a completed result)."""

    producer: str
    submitted: float
    appended: float
    weight_version: int | None = None


def _read_answers(
    cluster: Cluster, bounds: Bounds
) -> tuple[Counter[str], dict[str, list[_Sent]], list[str]]:
    """Answers per job (the parts of one split answer count once), each answer record of each
    job, and the jobs answered as crash-looped."""
    answers: Counter[str] = Counter()
    sent: dict[str, list[_Sent]] = {}
    crash_looped: list[str] = []
    for topic in bounds.answer_topics:
        if topic not in cluster.topics:
            continue
        seen_attempts: set[tuple[str, str]] = set()
        for log in cluster.topics[topic].logs:
            for record in log:
                try:
                    result = decode_result(record.value or b"")
                except SchemaError:
                    continue
                if result.job_id is None:
                    continue
                part = getattr(result, "part", None)
                attempt = getattr(part, "attempt", None)
                if isinstance(result, Completed) and isinstance(attempt, str):
                    if (result.job_id, attempt) in seen_attempts:
                        continue
                    seen_attempts.add((result.job_id, attempt))
                answers[result.job_id] += 1
                appended = record.timestamp_ms / 1000
                submitted = appended if record.submitted_ms is None else record.submitted_ms / 1000
                sent.setdefault(result.job_id, []).append(
                    _Sent(
                        record.producer,
                        submitted,
                        appended,
                        result.weight_version
                        if isinstance(result, Completed) and isinstance(result.weight_version, int)
                        else None,
                    )
                )
                if isinstance(result, Failed) and result.error.detail.startswith("not run again"):
                    crash_looped.append(result.job_id)
    return answers, sent, crash_looped


#: The faults during which a worker may lose what it answered but did not commit: a commit
#: or a hand-over cannot land, and the next owner runs again what the map does not name.
_OUTAGES = frozenset({"coordinator_outage", "broker_outage"})

#: The longest the simulated broker loses acknowledgements after a `lost_acks` fault.
_LOST_ACKS_S = 1.0

#: Records carry their times in whole milliseconds, events to the microsecond: an answer
#: appended in the millisecond a fault began may be stamped just before the fault.
_MS = 0.001


@dataclass
class _Causes:
    """What the history says can make a job answered twice, each cause at the word of the
    README's delivery semantics: a death (a kill, an exit, a member the group removed while
    its process lived on, a consumer that missed its poll interval) redoes what its process
    answered and no landed commit covered; a hand-over the group refused, or an outage that
    kept it from landing, does the same; an acknowledgement lost, or a batch retried without
    an idempotent producer, appends an answer twice; a job the trainer itself sent again is
    two jobs. Anything else (a clean hand-over, a rebalance, an adoption) answers nothing
    twice."""

    #: worker id -> (start time, process name), in time order
    starts: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    #: process -> when it died, exited, was removed from the group, or missed its poll
    deaths: dict[str, list[float]] = field(default_factory=dict)
    #: (client, tp) -> when the group refused a commit of the client for that partition
    refusals: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    #: windows during which commits could not land
    outages: list[tuple[float, float]] = field(default_factory=list)
    #: windows during which acknowledgements were lost (or, without idempotence, late)
    lost_acks: list[tuple[float, float]] = field(default_factory=list)
    #: jobs the trainer sent again
    resent: set[str] = field(default_factory=set)
    #: tp -> commits landed: (when, position, offsets its map names answered)
    commits: dict[str, list[tuple[float, int, frozenset[int]]]] = field(default_factory=dict)
    #: tp -> commits landed whose map its worker declared had left its answered section
    #: out to fit the cap: (when, position, offsets its map still names answered)
    degraded: dict[str, list[tuple[float, int, frozenset[int]]]] = field(default_factory=dict)

    def process(self, client: str, at: float) -> str | None:
        """The process of worker `client` (a client id ending in its worker id) alive at `at`."""
        worker_id = client.rsplit("-", 1)[-1]
        started = self.starts.get(worker_id, [])
        i = bisect.bisect_right(started, (at, "\uffff"))
        return started[i - 1][1] if i else None

    def uncovered(self, tp: str, offset: int, at: float) -> bool:
        """Whether no commit landed by `at` covers `offset` (below its position, or named
        answered in its map): a next owner reading then runs it."""
        landed = self.commits.get(tp, [])
        i = bisect.bisect_right(landed, (at, float("inf"), frozenset()))
        if not i:
            return True
        _, position, answered = landed[i - 1]
        return offset >= position and offset not in answered

    def explains(self, tp: str, offset: int, first: _Sent, again: _Sent) -> str | None:
        """The cause that lets `first` and `again` answer one job, or None."""
        process = self.process(first.producer, first.submitted)
        for died in self.deaths.get(process or "", []):
            if first.submitted - _MS <= died <= again.submitted + _MS and self.uncovered(
                tp, offset, died
            ):
                return f"a death of {process} at {died:.3f}s"
        for refused in self.refusals.get((first.producer, tp), []):
            if first.submitted - _MS <= refused <= again.submitted + _MS and self.uncovered(
                tp, offset, refused
            ):
                return f"a hand-over refused at {refused:.3f}s"
        for began, ended in self.outages:
            if (
                began <= again.submitted + _MS
                and ended >= first.submitted - _MS
                and self.uncovered(tp, offset, min(ended, again.submitted))
            ):
                return f"an outage from {began:.3f}s to {ended:.3f}s"
        for began, ended in self.lost_acks:
            if began - _MS <= first.appended <= ended or began - _MS <= first.submitted <= ended:
                return f"acknowledgements lost from {began:.3f}s"
        for landed, position, answered in self.degraded.get(tp, []):
            if (
                first.submitted - _MS <= landed <= again.submitted + _MS
                and offset >= position
                and offset not in answered
            ):
                return f"a map that left answered offsets out to fit its cap at {landed:.3f}s"
        return None


def _causes(  # noqa: PLR0912, PLR0915 - one branch per kind of event
    history: History, maps: list[tuple[Event, str, OffsetMap]], bounds: Bounds
) -> _Causes:
    causes = _Causes()
    answered_in = {id(event): offset_map.answered for event, _, offset_map in maps}
    process_of_member: dict[str, str] = {}
    process_of_client: dict[str, str] = {}
    alive: set[str] = set()
    began: dict[str, float] = {}
    declared: set[tuple[str, int, str]] = set()
    for event in history.events:
        fields = event.fields
        kind = event.kind
        if kind == "start":
            worker = fields["worker"]
            causes.starts.setdefault(worker.split("#")[0], []).append((event.at, worker))
            alive.add(worker)
        elif kind in ("kill", "exit"):
            causes.deaths.setdefault(fields["worker"], []).append(event.at)
            alive.discard(fields["worker"])
        elif kind == "joined":
            process_of_member[fields["member"]] = fields["process"]
            process_of_client[fields["client"]] = fields["process"]
            started = causes.starts.setdefault(fields["process"].split("#")[0], [])
            if not started or started[-1][1] != fields["process"]:
                # A history that records no start (the checker's own tests): its join.
                started.append((event.at, fields["process"]))
        elif kind == "member_removed" and fields["why"] != "left":
            process = process_of_member.get(fields["member"])
            if process in alive:
                causes.deaths.setdefault(process, []).append(event.at)
        elif kind == "poll_timeout":
            process = process_of_client.get(fields["client"])
            if process is not None:
                causes.deaths.setdefault(process, []).append(event.at)
        elif kind == "commit_refused":
            for tp in fields["tps"]:
                causes.refusals.setdefault((fields["client"], tp), []).append(event.at)
        elif kind == "map_degraded":
            declared.add((fields["tp"], fields["offset"], fields["metadata"]))
        elif kind == "commit":
            landed = (event.at, fields["offset"], answered_in.get(id(event), frozenset()))
            causes.commits.setdefault(fields["tp"], []).append(landed)
            if (fields["tp"], fields["offset"], fields.get("metadata") or "") in declared:
                causes.degraded.setdefault(fields["tp"], []).append(landed)
        elif kind == "trainer_resend":
            causes.resent.add(fields["job"])
        elif kind == "fault_lose_acks":
            causes.lost_acks.append((event.at, event.at + _LOST_ACKS_S))
        elif kind == "fault" and fields["fault"] in {*_OUTAGES, "slow_acks"}:
            began.setdefault(fields["fault"], event.at)
        elif kind == "fault_over":
            over = [*_OUTAGES, "slow_acks"] if fields["fault"] == "all" else [fields["fault"]]
            for fault in over:
                if (start := began.pop(fault, None)) is not None:
                    window = (start, event.at)
                    if fault in _OUTAGES:
                        causes.outages.append(window)
                    elif not bounds.idempotent:
                        causes.lost_acks.append(window)
    for fault, start in began.items():
        window = (start, bounds.end)
        if fault in _OUTAGES:
            causes.outages.append(window)
        elif not bounds.idempotent:
            causes.lost_acks.append(window)
    return causes


def _duplicates(  # noqa: PLR0917
    history: History,
    ledger: Ledger,
    maps: list[tuple[Event, str, OffsetMap]],
    sent: dict[str, list[_Sent]],
    handed_over: set[str],
    bounds: Bounds,
) -> list[Violation]:
    """`duplicates`: each answer of a trainer's job after its first needs a cause
    (`_Causes`): none is allowed across a clean hand-over, a rebalance or an adoption. The
    first job answered twice without one is flagged (its answers and who sent them)."""
    causes = _causes(history, maps, bounds)
    where = {job_id: source for source, (_, job_id) in ledger.records.items()}
    unexplained: list[tuple[float, str]] = []
    for job_id, answers in sent.items():
        source = where.get(job_id)
        if len(answers) < 2 or source is None or job_id in handed_over or job_id in causes.resent:
            continue
        tp, offset = source
        ordered = sorted(answers, key=lambda answer: answer.appended)
        for k, again in enumerate(ordered[1:], start=1):
            if not any(causes.explains(tp, offset, first, again) for first in ordered[:k]):
                answered = ", ".join(
                    f"{a.producer.rsplit('-', 1)[-1]} sent {a.submitted:.3f}s "
                    f"appended {a.appended:.3f}s"
                    for a in ordered
                )
                unexplained.append(
                    (
                        again.appended,
                        f"job {job_id} ({tp}@{offset}) answered {len(ordered)} times with no "
                        f"death, refused hand-over, outage or lost acknowledgement between: "
                        f"{answered}",
                    )
                )
                break
    unexplained.sort()
    return [
        Violation(
            "duplicates",
            f"{detail}"
            + (
                f" (and {len(unexplained) - 1} more jobs)"
                if i == 0 and len(unexplained) > 1
                else ""
            ),
            at,
        )
        for i, (at, detail) in enumerate(unexplained[:1])
    ]


def _stamps(history: History, sent: dict[str, list[_Sent]]) -> list[Violation]:
    """`wrong_weights`: a completed result carries the version of the weights that generated
    it (the engine's last generation of that job in that process before it was sent), and
    the process sending it still served those weights when it generated it."""
    generated: dict[tuple[str, str], list[tuple[float, int, bool]]] = {}
    starts: dict[str, list[tuple[float, str]]] = {}
    for event in history.of("generated", "start"):
        if event.kind == "start":
            worker = event.fields["worker"]
            starts.setdefault(worker.split("#")[0], []).append((event.at, worker))
        else:
            key = (event.fields["worker"], event.fields["job"])
            generated.setdefault(key, []).append(
                (event.at, event.fields["version"], bool(event.fields.get("interrupted")))
            )
    violations: list[Violation] = []
    for job_id, answers in sorted(sent.items()):
        for answer in answers:
            if answer.weight_version is None:
                continue
            worker_id = answer.producer.rsplit("-", 1)[-1]
            started = starts.get(worker_id, [])
            i = bisect.bisect_right(started, (answer.submitted, "\uffff"))
            if not i:
                continue
            process = started[i - 1][1]
            runs = generated.get((process, job_id), [])
            j = bisect.bisect_right(runs, (answer.submitted, float("inf")))
            made_with = runs[j - 1][1] if j else None
            # A job id sent to one process twice (a trainer's re-run of it) is generated twice:
            # the earlier sending's answer, sent late, carries its own whole generation's.
            whole = {version for _, version, interrupted in runs[:j] if not interrupted}
            if made_with != answer.weight_version and answer.weight_version not in whole:
                violations.append(
                    Violation(
                        "wrong_weights",
                        f"job {job_id} answered by {process} at {answer.submitted:.3f}s stamped "
                        f"weights {answer.weight_version}; "
                        + (
                            "that process never generated it"
                            if made_with is None
                            else f"its last generation there ran on weights {made_with}"
                        ),
                        answer.submitted,
                    )
                )
    return violations[:1]


#: Deaths from which a suspect runs only with nothing else in flight across its worker (the
#: breaker's `RUN_TOGETHER`): alone, or together with suspects of as many.
_QUIET_FROM = 2


def _suspects_not_alone(
    history: History, ledger: Ledger, maps: list[tuple[Event, str, OffsetMap]]
) -> list[Violation]:
    """`suspect_not_alone`: a record the landed map names in flight at two deaths or more
    generates with nothing else generating in its process but suspects of two deaths or more
    (README, "Jobs that kill the worker": they start only when the worker is quiet, and
    nothing else starts beside them)."""
    where = {job_id: source for source, (_, job_id) in ledger.records.items()}
    by_map = {id(event): offset_map.deaths for event, _, offset_map in maps}
    deaths_now: dict[str, Mapping[int, int]] = {}
    running: dict[str, dict[str, int]] = {}
    for event in history.events:
        fields = event.fields
        if event.kind == "commit" and id(event) in by_map:
            deaths_now[fields["tp"]] = by_map[id(event)]
        elif event.kind == "generating":
            # The record the worker ran, not the job id's: a job the trainer appended again
            # after its acknowledgement was lost has two records, and the first is not in the
            # ledger (seeds 700002, 700028, 700084 of the hostile flag set).
            source = _place(fields.get("record")) or where.get(fields["job"])
            deaths = deaths_now.get(source[0], {}).get(source[1], 0) if source else 0
            beside = running.setdefault(fields["worker"], {})
            others = [job for job in beside if job != fields["job"]]
            if (
                others
                and (deaths >= _QUIET_FROM or any(beside[job] >= _QUIET_FROM for job in others))
                and not (
                    deaths >= _QUIET_FROM and all(beside[job] >= _QUIET_FROM for job in others)
                )
            ):
                return [
                    Violation(
                        "suspect_not_alone",
                        f"{fields['worker']} started job {fields['job']} ({deaths} deaths) "
                        f"while {', '.join(f'{job} ({beside[job]} deaths)' for job in others[:4])} "
                        "generated",
                        event.at,
                    )
                ]
            beside[fields["job"]] = deaths
        elif event.kind == "generation_over":
            running.get(fields["worker"], {}).pop(fields["job"], None)
    return []


def _place(record: str | None) -> tuple[str, int] | None:
    """`(topic-partition, offset)` of a record named `topic-partition@offset`; None when it
    is not so named."""
    tp, _, offset = (record or "").rpartition("@")
    return (tp, int(offset)) if tp and offset.isdigit() else None


def _committed_maps(history: History, bounds: Bounds) -> Iterator[tuple[Event, str, OffsetMap]]:
    """Each commit of a jobs partition with the offset map it carries (those that carry one
    this checker reads: another's metadata says nothing it could judge)."""
    for event in history.of("commit"):
        metadata = event.fields.get("metadata") or ""
        tp = event.fields["tp"]
        if not metadata or not tp.startswith(f"{bounds.jobs_topic}-"):
            continue
        try:
            yield event, tp, decode_offset_map(event.fields["offset"], metadata)
        except OffsetMapError:
            continue


def _handed_over_in_flight(
    history: History,
    ledger: Ledger,
    maps: list[tuple[Event, str, OffsetMap]],
    sent: dict[str, list[_Sent]],
) -> set[str]:
    """The jobs a clean hand-over named as running while their answer was in flight: handed
    to the writer's producer before the hand-over, and appended after the rebalance began.
    An answer appended before was acknowledged before the revoke (the simulated broker
    acknowledges one hop after the append; lost acknowledgements count as a disruption), and
    one handed to the producer after the hand-over (sent again, or left queued) was the next
    owner's to give: either answered twice is the worker's defect."""
    rebalances = [event.at for event in history.of("rebalance")]  # in time order
    jobs: set[str] = set()
    for event, tp, offset_map in maps:
        if not offset_map.clean:
            continue
        latest = bisect.bisect_right(rebalances, event.at)
        began = rebalances[latest - 1] if latest else 0.0
        writer = event.fields["client"]
        for offset in offset_map.running:
            entry = ledger.records.get((tp, offset))
            if entry is not None and any(
                answer.producer == writer
                and answer.submitted <= event.at
                and answer.appended >= began
                for answer in sent.get(entry[1], ())
            ):
                jobs.add(entry[1])
    return jobs


def _blame(
    history: History,
    cluster: Cluster,
    ledger: Ledger,
    bounds: Bounds,
    maps: list[tuple[Event, str, OffsetMap]],
) -> list[Violation]:
    """`wrongly_blamed`: death counts in the committed offset maps against the kills that
    happened while each record was unanswered."""
    kills = [e.at for e in history.of("kill")] + _exits_with_no_way_to_hand_over(history)
    evictions = _live_owners_removed(history)
    jobs = cluster.topics[bounds.jobs_topic]
    worst: dict[tuple[str, int], tuple[int, float]] = {}
    for event, tp, offset_map in maps:
        for offset, deaths in offset_map.deaths.items():
            if deaths > worst.get((tp, offset), (0, 0.0))[0]:
                worst[(tp, offset)] = (deaths, event.at)
    violations = []
    for (tp, offset), (deaths, at) in sorted(worst.items()):
        partition = int(tp.rsplit("-", 1)[1])
        log = jobs.logs[partition]
        if offset >= len(log):
            continue
        appended = log[offset].timestamp_ms / 1000
        entry = ledger.records.get((tp, offset))
        # Kills until the count was committed: a record answered, delivered again after a
        # rebalance and in flight at a kill then is rightly counted.
        possible = sum(1 for k in kills if appended <= k <= at) + sum(
            1 for removed in evictions.get(tp, []) if appended <= removed <= at
        )
        if deaths > possible:
            violations.append(
                Violation(
                    "wrongly_blamed",
                    f"{tp}@{offset} ({entry[0].value if entry else 'unknown'}) counted {deaths} "
                    f"deaths; {possible} kills happened between its append and that commit",
                    at,
                )
            )
    return violations


def _exits_with_no_way_to_hand_over(history: History) -> list[float]:
    """When a process stopped with no way to land its hand-over: from its last landed commit
    to its exit no generation gave its member a place in the group, and at the exit the
    coordinator could not be reached or the group was rebalancing (a rebalance its own leave
    did not begin). Its last landed map names its jobs as running, as a kill's does, and its
    next owner cannot tell the two apart (seed 87031 of `--offset-metadata-max-bytes 300`:
    scaled in during coordinator outages that covered its whole grace; seed 94150 of
    `--flavour noida --static` with updates that kill the engine: a rebalance noida-db held
    open for 50 s, waiting for a restarting static member, took no commit of the member that
    stopped meanwhile)."""
    chances = _HandOverChances()
    stopped: list[float] = []
    for event in history.events:
        if event.kind == "exit" and chances.none_at_exit(event.fields):
            stopped.append(event.at)
        chances.see(event)
    return stopped


#: How long a generation must last, with the coordinator there, for a member to land a
#: hand-over in it: a read and a commit, each a round trip.
_HAND_OVER_WINDOW_S = 0.1


@dataclass
class _HandOverChances:
    """What the history says so far about where each process could land a commit."""

    process_of_client: dict[str, str] = field(default_factory=dict)
    #: process -> its member id now
    member_of: dict[str, str] = field(default_factory=dict)
    #: process -> when a commit of its landed last
    committed_at: dict[str, float] = field(default_factory=dict)
    #: process -> when it joined each generation (not one already rebalancing)
    joined_at: dict[str, list[float]] = field(default_factory=dict)
    #: when each rebalance began
    rebalances: list[float] = field(default_factory=list)
    #: member -> whether the group was rebalancing already when it left (or its leave began
    #: a rebalance)
    left_into_rebalance: dict[str, bool] = field(default_factory=dict)
    rebalancing_since: float | None = None

    def see(self, event: Event) -> None:
        fields = event.fields
        if event.kind == "joined":
            self.process_of_client[fields["client"]] = fields["process"]
            self.member_of[fields["process"]] = fields["member"]
            if self.rebalancing_since is None:  # else its generation was over already
                self.joined_at.setdefault(fields["process"], []).append(event.at)
        elif event.kind == "commit" and fields["client"] in self.process_of_client:
            self.committed_at[self.process_of_client[fields["client"]]] = event.at
        elif event.kind == "generation":
            self.rebalancing_since = None
        elif event.kind == "rebalance":
            self.rebalances.append(event.at)
            if self.rebalancing_since is None:
                self.rebalancing_since = event.at
        elif event.kind == "member_removed" and fields["why"] == "left":
            self.left_into_rebalance[fields["member"]] = self.rebalancing_since is not None

    def none_at_exit(self, exit_fields: dict[str, object]) -> bool:
        """Whether the process exiting had no way to land a hand-over since its last landed
        commit (see `_exits_with_no_way_to_hand_over`)."""
        process = str(exit_fields["worker"])
        member = self.member_of.get(process)
        last_commit = self.committed_at.get(process)
        if member is None or last_commit is None or self._placed_since(process, last_commit):
            return False  # nothing landed to name its jobs, or a generation to hand over in
        rebalancing = self.rebalancing_since is not None and self.left_into_rebalance.get(
            member, True
        )
        return bool(exit_fields.get("coordinator_away")) or rebalancing

    def _placed_since(self, process: str, since: float) -> bool:
        """Whether `process` joined a generation after `since` that no rebalance ended within
        `_HAND_OVER_WINDOW_S` (noida-db refuses commits from a rebalance's start on: a
        generation a member that died at once ended too soon is no place to hand over in,
        seed 94248)."""
        for joined in self.joined_at.get(process, []):
            if joined <= since:
                continue
            i = bisect.bisect_left(self.rebalances, joined)
            if i == len(self.rebalances) or self.rebalances[i] > joined + _HAND_OVER_WINDOW_S:
                return True
        return False


def _live_owners_removed(history: History) -> dict[str, list[float]]:
    """Per partition, when the group removed its owner for a missed session or rebalance
    timeout while the owner's process was alive (a coordinator away for longer than the
    timeouts): the member's jobs in flight were a death to the group, as Kafka's
    ClassicGroup sees it, though no process died."""
    alive: set[str] = set()
    process_of: dict[str, str] = {}
    held: dict[str, list[str]] = {}
    removed: dict[str, list[float]] = {}
    for event in history.events:
        fields = event.fields
        if event.kind == "start":
            alive.add(fields["worker"])
        elif event.kind in ("kill", "exit"):
            alive.discard(fields["worker"])
        elif event.kind == "joined":
            process_of[fields["member"]] = fields["process"]
        elif event.kind == "generation":
            held = {member: [str(tp) for tp in tps] for member, tps in fields["members"].items()}
        elif event.kind == "member_removed" and fields["why"] != "left":
            member = fields["member"]
            if process_of.get(member) in alive:
                for tp in held.get(member, []):
                    removed.setdefault(tp, []).append(event.at)
    return removed
