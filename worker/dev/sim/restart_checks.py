"""`restart_kept_old_weights`: what an update with `on_inflight: restart` promises of the jobs
it finds running (docs/operator/control-plane.md, "What an update does to jobs in flight":
they run again from the start on the new weights, and no answer carries the old version after
the acknowledgement).

Judged on the topics and the engine's own account, knowing nothing of how the worker does it:
a worker's acknowledgement `ok` of a `restart` update to version V (the status topic, with the
command's mode read from the control topic at the offset the acknowledgement names) is the
worker's latest update before one of its completed answers, the same process generated that
job after the acknowledgement (`generated`, `worker.dev.sim.paths`), and a completion's version
spans name a version the process did not load from its load of V on (`loaded`, `transferred`):
the weights it served before. A job whose generation ended before the acknowledgement may still
be answered after it with the old weights (its answer waited to be sent): it is not judged.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from schemas import (
    Completed,
    SchemaError,
    UpdateWeights,
    decode_command,
    decode_result,
)
from worker.dev.sim.checker import Violation, ok_update_acks
from worker.dev.sim.cluster import Cluster, StoredRecord
from worker.dev.sim.history import History

__all__ = ["check_restarts"]


def check_restarts(
    history: History,
    cluster: Cluster,
    *,
    answer_topics: Sequence[str],
    status_topic: str,
    control_topic: str,
) -> list[Violation]:
    """The first answer that broke the promise of a `restart` update, if any."""
    restarting = _restart_offsets(cluster, control_topic)
    updates = _updates_acknowledged(cluster, status_topic, restarting)
    starts: dict[str, list[tuple[float, str]]] = {}
    generated: dict[tuple[str, str], list[float]] = {}
    loads: dict[str, list[tuple[float, int]]] = {}
    for event in history.of("start", "generated", "loaded", "transferred"):
        process = event.fields["worker"]
        if event.kind == "start":
            starts.setdefault(process.split("#")[0], []).append((event.at, process))
        elif event.kind == "generated":
            generated.setdefault((process, event.fields["job"]), []).append(event.at)
        else:
            loads.setdefault(process, []).append((event.at, event.fields["version"]))
    for topic in answer_topics:
        for record in _records(cluster, topic):
            try:
                result = decode_result(record.value or b"")
            except SchemaError:
                continue
            if not isinstance(result, Completed) or result.job_id is None:
                continue
            worker = record.producer.rsplit("-", 1)[-1]
            submitted = (record.submitted_ms or record.timestamp_ms) / 1000
            acked = updates.get(worker, [])
            i = bisect.bisect_left(acked, (submitted,))
            if not i or not acked[i - 1][2]:
                continue  # its worker's latest update before the answer was no restart
            acked_at, version, _ = acked[i - 1]
            process = _alive(starts.get(worker, []), acked_at)
            if process is None or _alive(starts.get(worker, []), submitted) != process:
                continue
            ends = generated.get((process, result.job_id), [])
            j = bisect.bisect_right(ends, submitted)
            if not j or ends[j - 1] <= acked_at:
                continue  # generated before the update: its answer only waited to be sent
            spans = {
                span.version
                for completion in result.completions
                for span in (completion.weight_versions or [])
            }
            if spans - _loaded_since(loads.get(process, []), version, acked_at):
                return [
                    Violation(
                        "restart_kept_old_weights",
                        f"job {result.job_id} answered by {process} at {submitted:.3f}s on "
                        f"weights {sorted(spans)}, generated after it acknowledged a restart "
                        f"update to {version} at {acked_at:.3f}s",
                        submitted,
                    )
                ]
    return []


def _records(cluster: Cluster, topic: str) -> Iterable[StoredRecord]:
    found = cluster.topics.get(topic)
    for log in found.logs if found is not None else []:
        yield from log


def _restart_offsets(cluster: Cluster, control_topic: str) -> set[int]:
    """The control topic's offsets of the updates that say `on_inflight: restart` (the
    simulated control topic has one partition)."""
    restarting: set[int] = set()
    for record in _records(cluster, control_topic):
        try:
            command = decode_command(record.value or b"")
        except SchemaError:
            continue
        if isinstance(command, UpdateWeights) and command.on_inflight == "restart":
            restarting.add(record.offset)
    return restarting


def _updates_acknowledged(
    cluster: Cluster, status_topic: str, restarting: set[int]
) -> dict[str, list[tuple[float, int, bool]]]:
    """Per worker id, in time order: each `ok` acknowledgement of an update, when it was
    appended, the version it left the worker on and whether the update said `restart`."""
    updates: dict[str, list[tuple[float, int, bool]]] = {}
    for appended, ack in ok_update_acks(cluster, status_topic):
        updates.setdefault(ack.worker, []).append(
            (appended, ack.weight_version, ack.offset in restarting)
        )
    return {worker: sorted(acked) for worker, acked in updates.items()}


def _loaded_since(loads: list[tuple[float, int]], version: int, acked_at: float) -> set[int]:
    """The versions a process may generate on after acknowledging an update to `version`:
    that one, and each it loaded from that load on (a later update, whose acknowledgement may
    be appended after an answer it made, or a rollback to the old version)."""
    loaded_at = max((at for at, v in loads if v == version and at <= acked_at), default=acked_at)
    return {version} | {v for at, v in loads if at >= loaded_at}


def _alive(started: list[tuple[float, str]], at: float) -> str | None:
    """The process of a worker id started last by `at`."""
    i = bisect.bisect_right(started, (at, "\uffff"))
    return started[i - 1][1] if i else None
