"""The control plane's invariants, judged on a run's history, its control topic (every record,
replays among them) and its status topic (every record, also those retention deleted).

- `replay_obeyed`: a record whose command id came before (a replay, or a producer's retry)
  changes nothing: no acknowledgement names its offset, and no process acknowledges one
  command twice.
- `not_addressed_obeyed`: no worker acknowledges a command for another group or worker.
- `not_converged`: every worker live at the end serves the trainer's last update (version and
  id), unpaused, needing no weights, and acknowledged it within `CONVERGENCE_BOUND_S` of
  when it was sent or of its own start, whichever is later.
- `stale_start`: a process's first heartbeat, after its catch-up, names the update in force
  for it (the newest, in topic order, that a worker it addresses acknowledged `ok`) at some
  moment between its start and that heartbeat, or one nobody had answered at its start;
  when that update is a transfer, it says it needs it instead.
- `needs_weights_unsaid`: a process that started after the update in force for it was a
  transfer says `needs_weights` naming it (or a newer transfer) in every heartbeat until it
  acknowledges that transfer (its rendezvous still open) or a newer update.
- `generated_without_weights`: under `hold`, such a process generates nothing until then.
- `targeted_unanswered`: a command naming workers, sent while one of them was down, is
  acknowledged by that worker once it runs again (when it is live at the end).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from schemas import (
    Command,
    CommandAck,
    SchemaError,
    UpdateWeights,
    WorkerStatus,
    decode_command,
    decode_status,
)
from worker.dev.sim.checker import Violation
from worker.dev.sim.clock import EPOCH_S
from worker.dev.sim.cluster import Cluster
from worker.dev.sim.history import History

__all__ = ["CONVERGENCE_BOUND_S", "ControlBounds", "check_control"]

#: The longest a live worker may take to serve the trainer's last update, from when it was
#: sent or from the worker's own start, with the `control` flag set's settings: a `wait`
#: update waits for the jobs in flight (a slow job generates for at most 6 s, 40 tokens x 30
#: at 5 ms), a `restart` one for their answers to be acknowledged (at most 30 s,
#: `worker.control.commands._SETTLE_TIMEOUT_S`), and a worker stopping meanwhile drains for
#: its shutdown grace (10 s) before it closes; its supervisor's restart and the catch-up's
#: reads of both topics take a few seconds more.
CONVERGENCE_BOUND_S: Final = 6.0 + 30.0 + 10.0 + 14.0


@dataclass(frozen=True)
class ControlBounds:
    control_topic: str
    status_topic: str
    group: str
    end: float
    #: The workers hold their jobs while they lack weights (`--stale-weights-at-start hold`).
    hold: bool = True


@dataclass(frozen=True)
class _Sent:
    offset: int
    at: float
    command: Command


@dataclass(frozen=True)
class _Ack:
    at: float
    worker: str
    command_id: str
    ok: bool
    offset: int | None


@dataclass
class _Topics:
    #: The first record of each command id, in topic order.
    sent: list[_Sent] = field(default_factory=list)
    by_id: dict[str, _Sent] = field(default_factory=dict)
    #: Offsets of later records under an id already sent.
    copies: set[int] = field(default_factory=set)
    acks: list[_Ack] = field(default_factory=list)
    heartbeats: list[WorkerStatus] = field(default_factory=list)


def check_control(history: History, cluster: Cluster, bounds: ControlBounds) -> list[Violation]:
    topics = _read(cluster, bounds)
    starts = _starts(history)
    violations = _replays(topics, starts, bounds)
    violations += _converged(history, topics, starts, bounds)
    violations += _starts_in_force(history, topics, starts, bounds)
    violations += _targeted(history, topics, starts, bounds)
    return violations


def _read(cluster: Cluster, bounds: ControlBounds) -> _Topics:
    topics = _Topics()
    for record in cluster.topics[bounds.control_topic].logs[0]:
        try:
            command = decode_command(record.value or b"")
        except SchemaError:
            continue
        if command.command_id in topics.by_id:
            topics.copies.add(record.offset)
            continue
        sent = _Sent(record.offset, record.timestamp_ms / 1000, command)
        topics.sent.append(sent)
        topics.by_id[command.command_id] = sent
    for log in cluster.topics[bounds.status_topic].logs:
        for record in log:
            try:
                message = decode_status(record.value or b"")
            except SchemaError:
                continue
            if isinstance(message, CommandAck) and message.group == bounds.group:
                topics.acks.append(
                    _Ack(
                        message.at - EPOCH_S,
                        message.worker,
                        message.command_id,
                        message.outcome == "ok",
                        message.offset,
                    )
                )
            elif isinstance(message, WorkerStatus) and message.group == bounds.group:
                topics.heartbeats.append(message)
    topics.acks.sort(key=lambda a: a.at)
    topics.heartbeats.sort(key=lambda h: h.at)
    return topics


def _starts(history: History) -> dict[str, list[tuple[float, str]]]:
    """Per worker id, its processes' starts: (when, process name)."""
    starts: dict[str, list[tuple[float, str]]] = {}
    for event in history.of("start"):
        name = event.fields["worker"]
        starts.setdefault(name.split("#")[0], []).append((event.at, name))
    return starts


def _process_at(starts: dict[str, list[tuple[float, str]]], worker: str, at: float) -> str | None:
    started = starts.get(worker, [])
    i = bisect.bisect_right(started, (at, "\uffff"))
    return started[i - 1][1] if i else None


def _addresses(command: Command, group: str, worker: str) -> bool:
    return command.target.matches(group, worker)


def _replays(
    topics: _Topics, starts: dict[str, list[tuple[float, str]]], bounds: ControlBounds
) -> list[Violation]:
    violations = []
    seen: set[tuple[str | None, str]] = set()
    for ack in topics.acks:
        if ack.offset is not None and ack.offset in topics.copies:
            violations.append(
                Violation(
                    "replay_obeyed",
                    f"{ack.worker} acknowledged {ack.command_id} at the offset of a copy "
                    f"({ack.offset}, first at {topics.by_id[ack.command_id].offset})",
                    ack.at,
                )
            )
        process = _process_at(starts, ack.worker, ack.at)
        if (process, ack.command_id) in seen:
            violations.append(
                Violation(
                    "replay_obeyed",
                    f"{process} acknowledged {ack.command_id} twice",
                    ack.at,
                )
            )
        seen.add((process, ack.command_id))
        sent = topics.by_id.get(ack.command_id)
        if sent is not None and not _addresses(sent.command, bounds.group, ack.worker):
            violations.append(
                Violation(
                    "not_addressed_obeyed",
                    f"{ack.worker} acknowledged {ack.command_id}, for {sent.command.target}",
                    ack.at,
                )
            )
    return violations[:3]


def _last_update(topics: _Topics) -> _Sent | None:
    fleet_wide = [
        s
        for s in topics.sent
        if isinstance(s.command, UpdateWeights)
        and s.command.target.workers is None
        and s.command.target.group is None
    ]
    return fleet_wide[-1] if fleet_wide else None


def _converged(
    history: History,
    topics: _Topics,
    starts: dict[str, list[tuple[float, str]]],
    bounds: ControlBounds,
) -> list[Violation]:
    last = _last_update(topics)
    if last is None:
        return []
    assert isinstance(last.command, UpdateWeights)  # noqa: S101 - chosen so above
    violations = []
    for event in history.of("control_state"):
        f = event.fields
        process = f["worker"]
        worker = process.split("#")[0]
        wrong = []
        if f["weight_version"] != last.command.version:
            wrong.append(f"version {f['weight_version']}, not {last.command.version}")
        if f["weights_command_id"] != last.command.command_id:
            wrong.append(f"weights of {f['weights_command_id']}, not {last.command.command_id}")
        if f["paused"]:
            wrong.append("paused")
        if f["needs_weights"]:
            wrong.append("needing weights")
        started = next((at for at, name in starts.get(worker, []) if name == process), 0.0)
        since = max(last.at, started)
        acked = [
            a.at
            for a in topics.acks
            if a.worker == worker
            and a.command_id == last.command.command_id
            and a.ok
            and a.at >= started
        ]
        if not acked:
            wrong.append(f"never acknowledged {last.command.command_id}")
        elif acked[0] - since > CONVERGENCE_BOUND_S:
            wrong.append(f"acknowledged {last.command.command_id} {acked[0] - since:.1f} s late")
        if wrong:
            violations.append(
                Violation(
                    "not_converged",
                    f"{process} at the end: {', '.join(wrong)} (the trainer's last update "
                    f"{last.command.command_id} went out at {last.at:.3f}s)",
                    bounds.end,
                )
            )
    return violations


def _in_force(topics: _Topics, group: str, worker: str, at: float) -> _Sent | None:
    """The update in force for `worker` at `at`: the newest addressed to it, in topic order,
    that a worker it addresses had acknowledged `ok` by then."""
    applied = {
        a.command_id
        for a in topics.acks
        if a.ok
        and a.at <= at
        and (sent := topics.by_id.get(a.command_id)) is not None
        and _addresses(sent.command, group, a.worker)
    }
    newest = None
    for sent in topics.sent:
        command = sent.command
        if (
            isinstance(command, UpdateWeights)
            and command.command_id in applied
            and _addresses(command, group, worker)
        ):
            newest = sent
    return newest


def _first_ok(topics: _Topics, command_id: str) -> float | None:
    return next((a.at for a in topics.acks if a.command_id == command_id and a.ok), None)


def _processes(
    starts: dict[str, list[tuple[float, str]]], end: float
) -> Iterator[tuple[str, str, float, float]]:
    """(worker, process, start, next start or the end) of every process."""
    for worker, started in starts.items():
        for i, (at, name) in enumerate(started):
            until = started[i + 1][0] if i + 1 < len(started) else end
            yield worker, name, at, until


def _starts_in_force(  # noqa: PLR0912 - one rule per branch
    history: History,
    topics: _Topics,
    starts: dict[str, list[tuple[float, str]]],
    bounds: ControlBounds,
) -> list[Violation]:
    violations = []
    generated: dict[str, list[float]] = {}
    for event in history.of("generated"):
        generated.setdefault(event.fields["worker"], []).append(event.at)
    for worker, process, start, until in _processes(starts, bounds.end):
        beats = [
            h for h in topics.heartbeats if h.worker == worker and start <= h.at - EPOCH_S < until
        ]
        if not beats:
            continue
        first = beats[0]
        first_at = first.at - EPOCH_S
        # Every update in force at some moment of the catch-up, and those nobody had answered
        # at the start (the process applies them itself).
        allowed: set[str | None] = set()
        moments = [start, first_at] + [a.at for a in topics.acks if start <= a.at <= first_at]
        for moment in moments:
            now = _in_force(topics, bounds.group, worker, moment)
            allowed.add(None if now is None else now.command.command_id)
        at_start = _in_force(topics, bounds.group, worker, start)
        for sent in topics.sent:
            if (
                isinstance(sent.command, UpdateWeights)
                and _addresses(sent.command, bounds.group, worker)
                and (at_start is None or sent.offset > at_start.offset)
                and (_first_ok(topics, sent.command.command_id) or float("inf")) >= start
            ):
                allowed.add(sent.command.command_id)
        said = first.weights_command_id
        lacking = first.needs_weights_command_id
        if said not in allowed and not (first.needs_weights and lacking in allowed):
            violations.append(
                Violation(
                    "stale_start",
                    f"{process} started at {start:.3f}s serves {said} (version "
                    f"{first.weight_version}) after its catch-up; in force meanwhile: "
                    f"{', '.join(sorted(str(a) for a in allowed))}",
                    first_at,
                )
            )
        if at_start is None or not isinstance(at_start.command, UpdateWeights):
            continue
        transfer = at_start.command
        if transfer.backend == "checkpoint":
            continue
        newer = [
            a.at
            for a in topics.acks
            if a.worker == worker
            and a.ok
            and a.at >= start
            and (newer_sent := topics.by_id.get(a.command_id)) is not None
            and isinstance(newer_sent.command, UpdateWeights)
            # The transfer itself: taken while its rendezvous was still open.
            and newer_sent.offset >= at_start.offset
        ]
        has_weights_at = newer[0] if newer else until
        for beat in beats:
            if beat.at - EPOCH_S >= has_weights_at:
                break
            lacked = topics.by_id.get(beat.needs_weights_command_id or "")
            # The transfer in force at the start, or a newer one the fleet took meanwhile.
            if not beat.needs_weights or lacked is None or lacked.offset < at_start.offset:
                violations.append(
                    Violation(
                        "needs_weights_unsaid",
                        f"{process} started at {start:.3f}s, after transfer "
                        f"{transfer.command_id} (version {transfer.version}) was the fleet's, "
                        f"says needs_weights={beat.needs_weights} "
                        f"({beat.needs_weights_command_id}) serving {beat.weights_command_id}",
                        beat.at - EPOCH_S,
                    )
                )
                break
        if bounds.hold:
            made = [at for at in generated.get(process, []) if start <= at < has_weights_at]
            if made:
                violations.append(
                    Violation(
                        "generated_without_weights",
                        f"{process} started at {start:.3f}s lacking transfer "
                        f"{transfer.command_id} generated {len(made)} jobs before it had "
                        "newer weights, under the hold policy",
                        made[0],
                    )
                )
    return violations[:5]


def _targeted(
    history: History,
    topics: _Topics,
    starts: dict[str, list[tuple[float, str]]],
    bounds: ControlBounds,
) -> list[Violation]:
    live = {e.fields["worker"].split("#")[0] for e in history.of("control_state")}
    downs: dict[str, list[tuple[float, float]]] = {}
    deaths: dict[str, float] = {}
    for event in history.of("kill", "exit"):
        deaths.setdefault(event.fields["worker"], event.at)
    for worker, process, _, until in _processes(starts, bounds.end):
        died = deaths.get(process)
        if died is not None:
            downs.setdefault(worker, []).append((died, until))
    violations = []
    for sent in topics.sent:
        for worker in sent.command.target.workers or []:
            if worker not in live or not _addresses(sent.command, bounds.group, worker):
                continue
            if not any(down <= sent.at < up for down, up in downs.get(worker, [])):
                continue
            if not any(
                a.worker == worker and a.command_id == sent.command.command_id for a in topics.acks
            ):
                violations.append(
                    Violation(
                        "targeted_unanswered",
                        f"{sent.command.command_id} for {worker}, sent at {sent.at:.3f}s while "
                        "it was down, never acknowledged by it",
                        bounds.end,
                    )
                )
    return violations[:3]
