"""The trainer-level invariants: judged on what the client-driven trainers' calls recorded
(`worker.dev.sim.trainer`), knowing nothing of the client's implementation.

- `trainer_wrong_answer`: every result a call returns answers the very asking it sent: its job
  id and `submission_id`, the tag its metadata carried (new for every asking and every run),
  its prompt's length, `n` completions numbered 0..n-1, none longer than `max_tokens`, whole.
  Never an earlier asking's answer, a retried job's other sending, or another run's or another
  trainer's answer to the same id;
- `trainer_late`: every call ends by its deadline (the client's `timeout_s` from the call) and
  `SLACK_S`, with its results or a `RolloutError`; `trainer_hung`: a call of a client still
  running that never ended;
- `trainer_error`: a call ends in an error only for a reason the client documents: a job the
  broker refused (`could not be produced`), a client closed under it, or a job for which only
  answers echoing no submission came by its deadline (`echoing no submission_id`). In particular a call
  run again after the one before it ended is not refused (its ids `already in flight`, a turn
  `still in flight`): a failed call leaves nothing behind that stops its re-run;
- `trainer_left_pending`: when a loop has run every step, its client holds nothing in flight;
- `trainer_unfinished`: the last run of every trainer's loop (after any restart) runs every
  step by the end: every failed or expired turn and group was run again and completed;
- `trainer_update_unacknowledged`: `update_weights` returns only once every live worker of the
  target acknowledged the update `ok`: a worker whose heartbeat on the status topic, appended
  before the call, was still live when it returned (within `MISSED_HEARTBEATS` of its
  intervals) has an `ok` acknowledgement of that command on the status topic by then;
- `trainer_update_late`: an update call ends by its `timeout_s` and `UPDATE_SLACK_S`, returning
  or raising `RolloutError`; one that never ends while its client runs is `trainer_hung`;
- `trainer_stale_weights`: a completed result of a job that asked for `min_weight_version`
  carries that version or a newer one. That is what the documents promise of the versions a
  job runs on after an update (docs/operator/control-plane.md, "Versions on results"); they
  do not promise a job sent after `update_weights` returned without it the new weights (a
  worker that was not live then may serve it first), so that is not judged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

from schemas import CommandAck, SchemaError, WorkerStatus, decode_status
from worker.client.fleet import MISSED_HEARTBEATS
from worker.dev.sim.checker import Violation
from worker.dev.sim.clock import EPOCH_S
from worker.dev.sim.cluster import StoredRecord
from worker.dev.sim.history import Event, History

__all__ = ["DOCUMENTED_ERRORS", "SLACK_S", "check_trainers"]

#: How long after its deadline a call may end: the client answers expired jobs from a sweep
#: every 0.2 s (`worker.client.rollout._SWEEP_S`); the rest is margin for the loop's turns.
SLACK_S: Final = 0.5

#: How long after its `timeout_s` an update call may end: the client closes the clients it
#: opened for the call after its deadline.
UPDATE_SLACK_S: Final = 5.0

#: What a call may fail with (`RolloutError`s the client documents for a job in flight).
DOCUMENTED_ERRORS: Final = (
    "could not be produced",
    "the client was closed",
    "echoing no submission_id",
)


def check_trainers(
    history: History, end: float, status_logs: Iterable[Sequence[StoredRecord]] = ()
) -> list[Violation]:
    """Every violation of the trainer-level invariants in `history`, the run over at `end`,
    and `status_logs` (every record of the status topic, by partition); the first of each
    invariant, saying how many more there were."""
    found: dict[str, list[Violation]] = {}
    violations = [*_violations(history, end), *_update_violations(history, end, status_logs)]
    for violation in violations:
        found.setdefault(violation.invariant, []).append(violation)
    out = []
    for invariant, violations in found.items():
        first = min(violations, key=lambda v: v.at)
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        out.append(Violation(invariant, first.detail + more, first.at))
    return out


def _violations(history: History, end: float) -> Iterator[Violation]:  # noqa: PLR0912
    calls: dict[tuple[str, int], Event] = {}
    ended: set[tuple[str, int]] = set()
    stopped: dict[str, float] = {}
    finished: set[str] = set()
    incarnations: dict[str, list[str]] = {}
    for event in history.events:
        fields = event.fields
        kind = event.kind
        if kind == "rl_call":
            calls[(fields["trainer"], fields["call"])] = event
        elif kind in ("rl_return", "rl_error"):
            key = (fields["trainer"], fields["call"])
            call = calls.get(key)
            if call is None:
                continue
            ended.add(key)
            yield from _ended(call, event)
        elif kind in ("rl_killed", "rl_closing"):
            stopped.setdefault(fields["trainer"], event.at)
        elif kind == "rl_begin":
            trainer = fields["trainer"]
            names = incarnations.setdefault(trainer.split("#")[0], [])
            if trainer not in names:
                names.append(trainer)
        elif kind == "rl_loop_end":
            finished.add(fields["trainer"])
            if fields["in_flight"]:
                yield Violation(
                    "trainer_left_pending",
                    f"{fields['trainer']} ran every step; its client still holds "
                    f"{fields['in_flight']} jobs in flight",
                    event.at,
                )
    for key, call in calls.items():
        deadline = call.at + call.fields["timeout_s"] + SLACK_S
        if key in ended or stopped.get(key[0], end) <= deadline or end <= deadline:
            continue
        yield Violation(
            "trainer_hung",
            f"{key[0]} call {key[1]} ({call.fields['op']} of "
            f"{_ids(call.fields['jobs'])}, at {call.at:.3f}s) never ended; its deadline "
            f"was {deadline:.3f}s",
            deadline,
        )
    for plan in history.of("rl_plan"):
        names = incarnations.get(f"trainer-{plan.fields['name']}", [])
        last = names[-1] if names else None
        if last is None or (last not in finished and last not in stopped):
            yield Violation(
                "trainer_unfinished",
                f"trainer {plan.fields['name']}'s loop "
                + ("never started" if last is None else f"({last}) did not run every step"),
                end,
            )


def _ended(call: Event, end: Event) -> Iterator[Violation]:
    trainer, number = call.fields["trainer"], call.fields["call"]
    what = f"{trainer} call {number} ({call.fields['op']} at {call.at:.3f}s)"
    deadline = call.at + call.fields["timeout_s"]
    if end.at > deadline + SLACK_S:
        yield Violation(
            "trainer_late",
            f"{what} ended at {end.at:.3f}s, past its deadline {deadline:.3f}s",
            end.at,
        )
    if end.kind == "rl_error":
        error = end.fields["error"]
        if not any(reason in error for reason in DOCUMENTED_ERRORS):
            yield Violation("trainer_error", f"{what} failed: {error}", end.at)
        return
    asked = call.fields["jobs"]
    results = end.fields["results"]
    if len(results) != len(asked):
        yield Violation(
            "trainer_wrong_answer",
            f"{what}: {len(results)} results for {len(asked)} jobs",
            end.at,
        )
        return
    for job, result in zip(asked, results, strict=True):
        if (wrong := _not_the_answer(job, result)) is not None:
            yield Violation("trainer_wrong_answer", f"{what}: job {job['job']}: {wrong}", end.at)
        floor, version = job.get("min_version"), result.get("version")
        if "failed" not in result and floor is not None and (version is None or version < floor):
            yield Violation(
                "trainer_stale_weights",
                f"{what}: job {job['job']} asked for weights {floor} or newer; its result "
                f"carries {version}",
                end.at,
            )


def _update_violations(
    history: History, end: float, status_logs: Iterable[Sequence[StoredRecord]]
) -> Iterator[Violation]:
    """The update calls' invariants (`trainer_update_unacknowledged`, `trainer_update_late`,
    `trainer_hung`)."""
    heartbeats, acked = _read_status(status_logs)
    calls: dict[tuple[str, int], Event] = {}
    stopped: dict[str, float] = {}
    for event in history.events:
        fields = event.fields
        if event.kind == "rl_update":
            calls[(fields["trainer"], fields["call"])] = event
        elif event.kind in ("rl_killed", "rl_closing"):
            stopped.setdefault(fields["trainer"], event.at)
        elif event.kind in ("rl_updated", "rl_update_error"):
            call = calls.pop((fields["trainer"], fields["call"]), None)
            if call is None:
                continue
            what = (
                f"{fields['trainer']} update {fields['call']} to version "
                f"{call.fields['version']} (at {call.at:.3f}s)"
            )
            deadline = call.at + call.fields["timeout_s"]
            if event.at > deadline + UPDATE_SLACK_S:
                yield Violation(
                    "trainer_update_late",
                    f"{what} ended at {event.at:.3f}s, past its deadline {deadline:.3f}s",
                    event.at,
                )
            if event.kind == "rl_updated":
                live = _live_at(heartbeats, call.at, event.at)
                missing = sorted(
                    w for w in live if acked.get((fields["command_id"], w), end) > event.at
                )
                if missing:
                    yield Violation(
                        "trainer_update_unacknowledged",
                        f"{what} returned at {event.at:.3f}s; live workers "
                        f"{', '.join(missing)} had not acknowledged it",
                        event.at,
                    )
    for (trainer, number), call in calls.items():
        deadline = call.at + call.fields["timeout_s"] + UPDATE_SLACK_S
        if stopped.get(trainer, end) <= deadline or end <= deadline:
            continue
        yield Violation(
            "trainer_hung",
            f"{trainer} update {number} (at {call.at:.3f}s) never ended; its deadline was "
            f"{deadline:.3f}s",
            deadline,
        )


def _read_status(
    status_logs: Iterable[Sequence[StoredRecord]],
) -> tuple[list[tuple[float, WorkerStatus]], dict[tuple[str, str], float]]:
    """The heartbeats on the status topic, each with when it was appended; and when the first
    `ok` acknowledgement of each (command id, worker) was appended."""
    heartbeats: list[tuple[float, WorkerStatus]] = []
    acked: dict[tuple[str, str], float] = {}
    for log in status_logs:
        for record in log:
            try:
                message = decode_status(record.value or b"")
            except SchemaError:
                continue
            appended = record.timestamp_ms / 1000
            if isinstance(message, WorkerStatus):
                heartbeats.append((appended, message))
            elif isinstance(message, CommandAck) and message.outcome == "ok":
                key = (message.command_id, message.worker)
                acked[key] = min(acked.get(key, appended), appended)
    return heartbeats, acked


def _live_at(
    heartbeats: list[tuple[float, WorkerStatus]], asked: float, returned: float
) -> set[str]:
    """The workers a client reading the status topic between `asked` and `returned` finds live
    whenever it reads: a heartbeat appended before `asked` that is still within its liveness
    window at `returned`."""
    live = set()
    for appended, status in heartbeats:
        at = status.at - EPOCH_S
        window = MISSED_HEARTBEATS * status.interval_s
        if appended <= asked and returned - window <= at <= asked:
            live.add(status.worker)
    return live


def _not_the_answer(job: dict[str, Any], result: dict[str, Any]) -> str | None:
    """How `result` is not the answer to the asking `job`; None when it is."""
    if result["job"] != job["job"]:
        return f"the result is of job {result['job']}"
    if job["submission"] is not None and result["submission"] != job["submission"]:
        return f"the result names submission {result['submission']}, not {job['submission']}"
    completed = "failed" not in result
    if (completed or result["ask"] is not None) and result["ask"] != job["ask"]:
        return f"the result answers asking {result['ask']}, not {job['ask']}"
    if not completed:
        return None
    if result["prompt"] != job["prompt"]:
        return f"the result is to a prompt of {result['prompt']} tokens, not {job['prompt']}"
    if sorted(result["indices"]) != list(range(job["n"])):
        return f"completions {sorted(result['indices'])} for n = {job['n']}"
    if job["max_tokens"] is not None and result["longest"] > job["max_tokens"]:
        return f"a completion of {result['longest']} tokens, above max_tokens {job['max_tokens']}"
    if result["part"]:
        return "the result is one part of a split result"
    return None


def _ids(jobs: list[dict[str, Any]]) -> str:
    names = [job["job"] for job in jobs]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
