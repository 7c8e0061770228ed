"""The control plane's wire types: commands to the fleet, and what workers say back.

Commands go to the control topic (one partition, read whole by every worker, outside the jobs'
consumer group); acknowledgements and periodic statuses go to the status topic, keyed by worker
id. Both are JSON tagged unions: `kind` names a command, `type` a status message.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from schemas.errors import SchemaError

__all__ = [
    "Abort",
    "Command",
    "CommandAck",
    "ControlRecordError",
    "InflightMode",
    "Pause",
    "PauseMode",
    "ResetPrefixCache",
    "Resume",
    "StatusMessage",
    "Target",
    "UpdateWeights",
    "WorkerStatus",
    "command_signature",
    "decode_command",
    "decode_status",
    "sign_command",
    "signature_problem",
]

#: What a pause does to jobs in flight: `abort` answers them `aborted` (retryable, with their
#: partial completions), `wait` lets them finish, `keep` freezes them until `resume`.
PauseMode = Literal["abort", "wait", "keep"]
#: What a weight update does to jobs in flight: `keep` continues them on the new weights (two
#: version spans), `wait` lets them finish on the old ones first, `restart` runs them again on
#: the new ones, `abort` answers them `aborted` with their partial completions.
InflightMode = Literal["keep", "wait", "restart", "abort"]

CommandId = Annotated[str, Meta(min_length=1, max_length=256)]


class Target(msgspec.Struct, frozen=True, kw_only=True):
    """Who a command is for: workers of `group`, or the named `workers`; both unset: everyone."""

    group: str | None = None
    workers: list[str] | None = None

    def matches(self, group: str, worker: str) -> bool:
        if self.workers is not None and worker not in self.workers:
            return False
        return self.group is None or self.group == group


class _Command(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    command_id: CommandId
    target: Target = msgspec.field(default_factory=Target)
    #: Unix seconds when it was issued. Workers refuse a command issued longer ago than their
    #: `--command-max-age-s` (or ahead of their clock by more than `--max-clock-skew-s`), so a
    #: record produced again after the topic was trimmed is not obeyed. Required under a key,
    #: and for a rollback (`force`).
    issued_at: float | None = None
    #: HMAC-SHA256 (hex) of the command under the fleet's key (see `command_signature`); a
    #: fleet started with `--control-hmac-key` applies no command without a good one.
    signature: str | None = None


class Pause(_Command, frozen=True, kw_only=True, tag="pause"):
    """Start no new job until `resume`; `mode` says what happens to jobs in flight."""

    mode: PauseMode = "wait"


class Resume(_Command, frozen=True, kw_only=True, tag="resume"):
    """Undo `pause`: jobs start again, frozen ones continue."""


class UpdateWeights(_Command, frozen=True, kw_only=True, tag="update_weights"):
    """Serve new weights, stamped `version` (the trainer's step), without a restart.

    `path` is a checkpoint directory on storage the workers share (the default `checkpoint`
    backend). With `backend` `nccl` or `ipc`, the trainer streams the weights from its own GPU
    memory through vLLM's weight-transfer engine: `init_info` and `update_info` are passed to
    it as they are.
    """

    version: Annotated[int, Meta(ge=0)]
    path: Annotated[str, Meta(min_length=1)] | None = None
    on_inflight: InflightMode = "wait"
    backend: Literal["checkpoint", "nccl", "ipc"] = "checkpoint"
    init_info: dict[str, Any] | None = None
    update_info: dict[str, Any] | None = None
    #: Serve `version` even when it is older than the one served (a rollback); without it a
    #: worker refuses to move its version backwards.
    force: bool = False

    def __post_init__(self) -> None:
        if self.backend == "checkpoint" and self.path is None:
            raise ValueError("update_weights from a checkpoint needs `path`")
        if self.backend != "checkpoint" and self.update_info is None:
            raise ValueError(f"update_weights over {self.backend} needs `update_info`")


class Abort(_Command, frozen=True, kw_only=True, tag="abort"):
    """Answer the matching jobs in flight `aborted` (retryable, with partial completions):
    those named in `job_ids`, or whose metadata holds every entry of `metadata`."""

    job_ids: list[str] | None = None
    metadata: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if (self.job_ids is None) == (self.metadata is None):
            raise ValueError("abort needs exactly one of `job_ids` or `metadata`")

    def matches(self, job_id: str, metadata: dict[str, str]) -> bool:
        if self.job_ids is not None:
            return job_id in self.job_ids
        return all(metadata.get(k) == v for k, v in (self.metadata or {}).items())


class ResetPrefixCache(_Command, frozen=True, kw_only=True, tag="reset_prefix_cache"):
    """Drop the engine's prefix cache (its entries are keyed by tokens, not by weights)."""


Command = Pause | Resume | UpdateWeights | Abort | ResetPrefixCache


class CommandAck(msgspec.Struct, frozen=True, kw_only=True, tag="ack", tag_field="type"):
    """One worker's answer to one command."""

    worker: str
    group: str
    command_id: str
    kind: str
    outcome: Literal["ok", "failed"]
    detail: str = ""
    duration_s: float
    #: The worker's weight version after the command.
    weight_version: int
    at: float
    #: The command's offset in the control topic (None from workers that predate it).
    offset: int | None = None


class WeightReload(msgspec.Struct, frozen=True, kw_only=True):
    """How a worker's engine takes a new checkpoint, and why it was chosen."""

    #: `in-place`: the running engine loads the checkpoint (a fraction of a second; running
    #: requests can be kept). `rebuild`: a new engine is built on it (as long as a start).
    mode: Literal["in-place", "rebuild"]
    reason: str


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True, tag="status", tag_field="type"):
    """A worker's periodic heartbeat on the status topic."""

    worker: str
    group: str
    model: str
    weight_version: int
    paused: bool
    in_flight: int
    #: Jobs behind the end of the worker's partitions (None before the first measure).
    lag: int | None
    engine_healthy: bool
    uptime_s: float
    at: float
    #: Seconds between heartbeats: a worker silent for a few of them is gone. Bounded as the
    #: worker's setting is, so one forged heartbeat cannot keep a phantom worker "live" for days.
    interval_s: Annotated[float, Meta(gt=0, le=3600)]
    #: The worker holds its jobs (or serves older weights, if told to) because the latest
    #: update in the control topic was a weight transfer it cannot repeat after a restart:
    #: it waits for the next `update_weights`.
    needs_weights: bool = False
    #: How the engine takes a checkpoint, and why; None from workers that predate it.
    weight_reload: WeightReload | None = None
    #: The `update_weights` whose weights it serves (None: the weights it started on).
    weights_command_id: str | None = None
    #: The fleet's `pause` in force on it (None: not paused by the fleet).
    pause_command_id: str | None = None
    #: With `needs_weights` after a restart: the fleet's newest update, a weight transfer it
    #: could not repeat. Repeated in every heartbeat, so a worker starting once that update's
    #: acknowledgements have left the status topic's tail still learns the fleet is on it.
    needs_weights_command_id: str | None = None
    #: The control topic's offset it has applied every command below (None: not following).
    #: A worker starting later takes the state of the commands below it from what the fleet
    #: said, and applies the ones at or above it itself.
    control_offset: int | None = None


class ControlRecordError(
    msgspec.Struct, frozen=True, kw_only=True, tag="control_error", tag_field="type"
):
    """Control records a worker could not read (skipped; the worker goes on): the latest
    at `offset`, standing for `count` skipped since its previous report (one report per
    heartbeat interval at most)."""

    worker: str
    group: str
    offset: int
    detail: str
    at: float
    count: int = 1


StatusMessage = CommandAck | WorkerStatus | ControlRecordError

_COMMAND_DECODER: Final = msgspec.json.Decoder(Command)
_STATUS_DECODER: Final = msgspec.json.Decoder(StatusMessage)
_FIELDS_DECODER: Final = msgspec.json.Decoder(dict[str, Any])
_ENCODER: Final = msgspec.json.Encoder()
_CANONICAL: Final = msgspec.json.Encoder(order="sorted")


def decode_command(data: bytes | str) -> Command:
    """Decode one control record; SchemaError (naming the field) when it is not a command."""
    try:
        return _COMMAND_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise SchemaError(f"not a control command: {exc}") from None


def decode_status(data: bytes | str) -> StatusMessage:
    """Decode one status-topic record; SchemaError when it is not one."""
    try:
        return _STATUS_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise SchemaError(f"not a status message: {exc}") from None


def command_signature(fields: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 (hex) of a command's canonical encoding: its JSON object as it travels,
    without `signature`, keys sorted at every level, no whitespace, as msgspec writes it.

    Computed over the fields as sent (not over this schema's idea of them), so a worker with
    an older or newer schema checks the same bytes the sender signed.
    """
    unsigned = {k: v for k, v in fields.items() if k != "signature"}
    return hmac.new(key, _CANONICAL.encode(unsigned), hashlib.sha256).hexdigest()


def sign_command(command: Command, key: bytes) -> Command:
    """`command` carrying its signature under `key`."""
    unsigned = msgspec.structs.replace(command, signature=None)
    fields = _FIELDS_DECODER.decode(_ENCODER.encode(unsigned))
    return msgspec.structs.replace(command, signature=command_signature(fields, key))


def signature_problem(data: bytes | str, key: bytes) -> str | None:
    """Why the control record `data` is not signed by `key` (None: it is)."""
    try:
        fields = _FIELDS_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return "not a JSON object"
    given = fields.get("signature")
    if given is None:
        return "unsigned"
    if not isinstance(given, str):
        return "signature is not a string"
    expected = command_signature(fields, key)
    # Compared as bytes: compare_digest refuses str holding non-ASCII characters.
    if not hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogatepass")):
        return "bad signature"
    return None
