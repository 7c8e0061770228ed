"""Settings: one frozen object, read once from CLI flags and `VKW_*` environment variables."""

from __future__ import annotations

import argparse
import functools
import os
import re
import socket
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from worker.core.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "SECRET_FIELDS",
    "Settings",
    "add_settings_arguments",
    "check_cross_field_rules",
    "settings_from",
]

ENV_PREFIX: Final = "VKW_"
# VKW_* variables that are not settings: the CPU test backend's opt-in (tests/support), which
# the engine's spawned processes must inherit, and the chaos tests' crash points.
NOT_SETTINGS: Final = frozenset({"VKW_TRITON_CPU_SHIM", "VKW_FAILPOINTS"})
MiB: Final = 1024 * 1024

# Large enough for an 8k-token completion of a 94-layer, top-8 model (Qwen3-235B-A22B):
# 8192 x 94 x 8 uint8 = 5.9 MiB, 7.9 MiB as base64, plus tokens, logprobs and text.
DEFAULT_MAX_RESULT_BYTES: Final = 16 * MiB

Port = Annotated[int, Meta(ge=0, le=65535)]
TopicName = Annotated[str, Meta(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")]


def _d(text: str) -> Meta:
    return Meta(description=text)


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the worker and its CLI can be told. Field `x_y` is flag `--x-y` and env `VKW_X_Y`."""

    # Kafka connection
    bootstrap_servers: Annotated[
        str, Meta(min_length=1), _d("Kafka bootstrap servers, host:port[,host:port]")
    ] = "localhost:9092"
    security_protocol: Annotated[
        Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"], _d("Kafka security protocol")
    ] = "PLAINTEXT"
    sasl_mechanism: Annotated[
        Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None,
        _d("SASL mechanism (with SASL_* protocols)"),
    ] = None
    sasl_username: Annotated[str | None, _d("SASL username")] = None
    sasl_password: Annotated[str | None, _d("SASL password (secret: prefer the env var)")] = None
    ssl_cafile: Annotated[str | None, _d("CA bundle that verifies the brokers (PEM)")] = None
    ssl_certfile: Annotated[str | None, _d("client certificate for mutual TLS (PEM)")] = None
    ssl_keyfile: Annotated[str | None, _d("client private key for mutual TLS (PEM)")] = None
    ssl_key_password: Annotated[str | None, _d("password of the client key (secret)")] = None

    # Topics and group
    jobs_topic: Annotated[TopicName, _d("topic the jobs are read from")] = "vkw.jobs"
    results_topic: Annotated[TopicName, _d("topic results are written to, keyed by job_id")] = (
        "vkw.results"
    )
    dead_letter_topic: Annotated[TopicName, _d("topic unreadable job records are copied to")] = (
        "vkw.jobs.dlq"
    )
    reply_topics: Annotated[
        str | None,
        _d(
            "regular expression (whole name) of the topics a job's reply_to may name; unset: "
            "none, every answer goes to the results topic"
        ),
    ] = None
    control_topic: Annotated[
        TopicName, _d("commands for the fleet (one partition; every worker reads all of it)")
    ] = "vkw.control"
    status_topic: Annotated[
        TopicName, _d("workers' acknowledgements and heartbeats, keyed by worker id")
    ] = "vkw.status"
    status_interval_s: Annotated[
        float, Meta(gt=0, le=3600), _d("seconds between a worker's heartbeats on the status topic")
    ] = 5.0
    group_id: Annotated[str, Meta(min_length=1), _d("consumer group the workers share")] = (
        "vllm-kafka-worker"
    )
    group_instance_id: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        _d(
            "static membership id: a restarted worker with the same id gets its partitions back at once"
        ),
    ] = None
    leave_group_on_stop: Annotated[
        bool,
        _d(
            "a static member leaves the group when it stops, so its partitions move at once "
            "(scaling in); without it they wait for it for the session timeout (a restart)"
        ),
    ] = False
    create_topics: Annotated[
        bool, _d("create the jobs, results, dead-letter, control and status topics when missing")
    ] = False
    topic_partitions: Annotated[
        int, Meta(ge=1, le=10_000), _d("partitions of topics created by --create-topics")
    ] = 8
    topic_replication_factor: Annotated[
        int, Meta(ge=1, le=32), _d("replication factor of topics created by --create-topics")
    ] = 1

    # Engine
    engine: Annotated[Literal["vllm", "mock"], _d("generation engine")] = "vllm"
    weight_version: Annotated[
        int, Meta(ge=0), _d("version of the weights the engine starts with (the trainer's step)")
    ] = 0
    max_version_hold_s: Annotated[
        float,
        Meta(gt=0, le=30 * 86400),
        _d(
            "longest a job's min_weight_version holds its partition; then it is answered "
            "expired and the partition moves on"
        ),
    ] = 600.0
    weight_reload: Annotated[
        Literal["auto", "in-place", "rebuild"],
        _d(
            "how vLLM takes a new checkpoint: auto (in place when reloading the served "
            "checkpoint in place at start leaves the probe unchanged, else rebuild), in-place, "
            "or rebuild (a new engine in the process)"
        ),
    ] = "auto"
    max_in_flight: Annotated[
        Annotated[int, Meta(ge=1, le=100_000)] | None,
        _d("jobs running at once; default 2 x the engine's max_num_seqs"),
    ] = None
    mock_per_token_latency_ms: Annotated[
        float, Meta(ge=0), _d("mock engine: simulated time per token")
    ] = 0.0
    mock_num_layers: Annotated[int, Meta(ge=1, le=1024), _d("mock engine: decoder layers")] = 48
    mock_top_k: Annotated[int, Meta(ge=1, le=256), _d("mock engine: experts per token")] = 8
    mock_num_experts: Annotated[
        int, Meta(ge=1, le=65_536), _d("mock engine: experts per layer")
    ] = 128
    mock_max_num_seqs: Annotated[
        int, Meta(ge=1, le=65_536), _d("mock engine: simulated batch size")
    ] = 256
    mock_max_model_len: Annotated[int, Meta(ge=2), _d("mock engine: context length")] = 32_768
    mock_in_place_updates: Annotated[
        bool,
        _d("mock engine: weight updates keep running requests, as an in-place reload would"),
    ] = False
    weights_root: Annotated[
        tuple[Annotated[str, Meta(min_length=1)], ...],
        _d(
            "directory an update_weights checkpoint must lie under, symlinks resolved "
            "(repeatable; env: paths joined by ':'); the start-up model is not checked"
        ),
    ] = ()
    allow_any_weights_path: Annotated[
        bool,
        _d("take update_weights checkpoints from any path (without it and --weights-root: none)"),
    ] = False
    allow_remote_code_updates: Annotated[
        bool,
        _d(
            "take update_weights checkpoints that bring their own code (auto_map, *.py files); "
            "with --trust-remote-code among the engine arguments, that code runs"
        ),
    ] = False
    allow_weight_transfer: Annotated[
        bool,
        _d("take nccl / ipc weight transfers (the trainer names the rendezvous)"),
    ] = False
    control_hmac_key: Annotated[
        Annotated[str, Meta(min_length=16)] | None,
        _d(
            "key every control command must be signed with (HMAC-SHA256); unsigned or badly "
            "signed commands are refused (secret: prefer the env var)"
        ),
    ] = None
    command_max_age_s: Annotated[
        float,
        Meta(gt=0),
        _d(
            "refuse a control command issued (its issued_at) longer ago than this: a record "
            "produced again after the topic was trimmed is not obeyed"
        ),
    ] = 3600.0
    max_clock_skew_s: Annotated[
        float,
        Meta(ge=0, le=3600),
        _d("how far the trainer's clock may be off this worker's when issued_at is checked"),
    ] = 300.0
    stale_weights_at_start: Annotated[
        Literal["hold", "serve"],
        _d(
            "when the control topic's latest update is a weight transfer, which a restarted "
            "worker cannot repeat: hold jobs until the next update, or serve the newest "
            "checkpoint update meanwhile"
        ),
    ] = "hold"
    mock_crash_token_id: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _d("mock engine: a job whose prompt holds this token id kills the process (SIGKILL)"),
    ] = None

    # Delivery
    max_result_bytes: Annotated[
        int,
        Meta(ge=64 * 1024, le=1024 * MiB),
        _d("largest encoded result; sizes producer and fetches"),
    ] = DEFAULT_MAX_RESULT_BYTES
    payload_store: Annotated[
        str | None,
        _d(
            "file:///dir shared with the trainers: routed experts of a completion too large for "
            "one record are written there and referenced (unset: answered result_too_large)"
        ),
    ] = None
    enable_idempotence: Annotated[
        bool, _d("idempotent producer (no duplicates from producer retries)")
    ] = True
    compression_type: Annotated[
        Literal["zstd", "gzip", "snappy", "lz4", "none"], _d("compression of results")
    ] = "zstd"
    publish_timeout_s: Annotated[
        float,
        Meta(gt=0),
        _d("how long a result may wait for the broker before the worker gives up"),
    ] = 120.0
    commit_interval_ms: Annotated[
        int, Meta(ge=0, le=60_000), _d("least time between offset commits")
    ] = 500
    max_crash_attempts: Annotated[
        int,
        Meta(ge=0, le=100),
        _d(
            "process deaths a job may be in flight at (at least 3: the first, its retry beside "
            "other jobs, and one running alone; from 5, suspects of two deaths first run "
            "together) before it is answered failed and dead-lettered instead of run again; "
            "0: no breaker"
        ),
    ] = 5
    offset_map_max_bytes: Annotated[
        int,
        Meta(ge=0, le=1_048_576),
        _d(
            "largest offset map in a commit's metadata (answered jobs past the committed "
            "offset, skipped after a restart; the crash-loop breaker's counts); below the "
            "broker's offset.metadata.max.bytes; 0: no map (needs --max-crash-attempts 0)"
        ),
    ] = 3072
    poll_timeout_ms: Annotated[int, Meta(ge=1, le=60_000), _d("longest wait of one fetch")] = 200
    session_timeout_ms: Annotated[int, Meta(ge=1000), _d("group session timeout")] = 10_000
    heartbeat_interval_ms: Annotated[int, Meta(ge=100), _d("group heartbeat interval")] = 3_000
    max_poll_interval_ms: Annotated[
        int, Meta(ge=1000), _d("longest gap between fetches before eviction")
    ] = 300_000
    rebalance_timeout_ms: Annotated[
        int,
        Meta(ge=1000, le=3_600_000),
        _d("time the group gives a member to rejoin; above revoke grace + commit timeout"),
    ] = 60_000

    # Lifecycle and observability
    shutdown_grace_s: Annotated[
        float, Meta(ge=0), _d("time in-flight jobs get to finish on SIGTERM")
    ] = 30.0
    revoke_grace_s: Annotated[
        float,
        Meta(ge=0),
        _d("time in-flight jobs of revoked partitions get to finish on rebalance"),
    ] = 10.0
    health_check_interval_s: Annotated[
        float, Meta(gt=0), _d("how often the engine's health is checked between jobs")
    ] = 10.0
    commit_timeout_s: Annotated[
        float, Meta(gt=0), _d("longest wait for one offset commit before retrying it later")
    ] = 10.0
    close_timeout_s: Annotated[
        float, Meta(gt=0), _d("longest wait for each shutdown step (flush, commit, close)")
    ] = 15.0
    metrics_port: Annotated[
        Port | None, _d("port of /metrics, /healthz and /readyz (off when unset)")
    ] = None
    metrics_host: Annotated[str, _d("address the metrics server binds")] = "0.0.0.0"  # noqa: S104
    worker_id: Annotated[str, Meta(min_length=1), _d("name reported in results and logs")] = (
        f"{socket.gethostname()}-{os.getpid()}"
    )
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], _d("log level")] = "INFO"

    def __post_init__(self) -> None:
        check_cross_field_rules(self)

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in self.redacted().items())})"

    def redacted(self) -> dict[str, Any]:
        """The settings with secrets masked, for logs."""
        values = msgspec.structs.asdict(self)
        return {
            k: ("***" if k in SECRET_FIELDS and v is not None else v) for k, v in values.items()
        }


def check_cross_field_rules(settings: Settings) -> None:
    """Refuse settings whose fields are each valid but do not fit together (ValueError, which
    msgspec reports as the settings' validation error): one field's limits live in its
    `Meta`, the rules between fields here."""
    if settings.heartbeat_interval_ms >= settings.session_timeout_ms:
        raise ValueError("heartbeat_interval_ms must be lower than session_timeout_ms")
    if settings.security_protocol.startswith("SASL") and (
        settings.sasl_mechanism is None
        or settings.sasl_username is None
        or settings.sasl_password is None
    ):
        raise ValueError(
            f"{settings.security_protocol} needs sasl_mechanism, sasl_username and sasl_password"
        )
    if (settings.ssl_certfile is None) != (settings.ssl_keyfile is None):
        raise ValueError("ssl_certfile and ssl_keyfile go together")
    if settings.reply_topics is not None:
        try:
            re.compile(settings.reply_topics)
        except re.error as exc:
            raise ValueError(
                f"reply_topics {settings.reply_topics!r} is not a regex: {exc}"
            ) from None
    for root in settings.weights_root:
        if not Path(root).is_absolute():
            raise ValueError(f"weights_root must be an absolute directory, got {root!r}")
    if settings.weights_root and settings.allow_any_weights_path:
        raise ValueError("weights_root and allow_any_weights_path exclude each other")
    if settings.payload_store is not None and not settings.payload_store.startswith("file:///"):
        raise ValueError(
            f"payload_store must be a file:///absolute/dir URI, got {settings.payload_store!r}"
        )
    if settings.offset_map_max_bytes == 0 and settings.max_crash_attempts > 0:
        # The breaker's counts travel in the offset map: without one it counts nothing.
        raise ValueError(
            "--offset-map-max-bytes 0 leaves the crash-loop breaker nothing to keep its "
            f"counts in: set --max-crash-attempts 0 too (it is {settings.max_crash_attempts})"
        )
    revoke_ms = (settings.revoke_grace_s + settings.commit_timeout_s) * 1000
    if settings.rebalance_timeout_ms <= revoke_ms:
        # A revoke drains for revoke_grace_s and then commits; a member that takes longer
        # than the rebalance timeout to rejoin is dropped, which starts another rebalance.
        raise ValueError(
            f"rebalance_timeout_ms ({settings.rebalance_timeout_ms}) must be above "
            f"revoke_grace_s + commit_timeout_s ({revoke_ms:.0f} ms)"
        )


SECRET_FIELDS: Final = frozenset({"sasl_password", "ssl_key_password", "control_hmac_key"})
_FIELDS: Final = {f.name: f for f in msgspec.structs.fields(Settings)}


@functools.cache
def _hints() -> dict[str, Any]:
    # Evaluated once: each evaluation compiles every field's annotation (they are strings under
    # `from __future__ import annotations`), 4 ms a field, and a parser describes all 65.
    return typing.get_type_hints(Settings, include_extras=True)


def describe(field: str) -> str:
    """The one-line description of a setting (from its `Meta(description=...)`)."""
    hint = _hints()[field]
    for meta in getattr(hint, "__metadata__", ()):
        if isinstance(meta, Meta) and meta.description:
            return meta.description
    raise KeyError(field)  # pragma: no cover - every field has one; a test checks it


def flag_name(field: str) -> str:
    """`max_in_flight` -> `--max-in-flight`."""
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    """`max_in_flight` -> `VKW_MAX_IN_FLIGHT`."""
    return ENV_PREFIX + field.upper()


def _is_bool(field: str) -> bool:
    return _FIELDS[field].default is True or _FIELDS[field].default is False


def _is_repeatable(field: str) -> bool:
    return isinstance(_FIELDS[field].default, tuple)


def add_settings_arguments(
    parser: argparse.ArgumentParser, fields: Sequence[str] | None = None
) -> None:
    """Add a flag per setting (all, or those named); unset flags stay None so env vars can fill them."""
    for name in fields or list(_FIELDS):
        help_text = describe(name)
        default = _FIELDS[name].default
        shown = (
            "not shown"
            if name in SECRET_FIELDS
            else ("unset" if default is None or default == () else default)
        )
        help_text = f"{help_text} [env {env_name(name)}; default {shown}]"
        if _is_bool(name):
            parser.add_argument(
                flag_name(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif _is_repeatable(name):
            parser.add_argument(
                flag_name(name),
                dest=name,
                action="append",
                default=None,
                metavar="VALUE",
                help=help_text,
            )
        else:
            parser.add_argument(
                flag_name(name), dest=name, default=None, metavar="VALUE", help=help_text
            )


def settings_from(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings: a flag beats its env var, which beats the default. Raise `ConfigError`."""
    environ = os.environ if environ is None else environ
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    unknown_env = sorted(
        k
        for k in environ
        if k.startswith(ENV_PREFIX)
        and k[len(ENV_PREFIX) :].lower() not in _FIELDS
        and k not in NOT_SETTINGS
    )
    if unknown_env:
        raise ConfigError(f"unknown environment variable {unknown_env[0]} (settings: see --help)")
    raw: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name in _FIELDS:
        if (value := environ.get(env_name(name))) is not None:
            raw[name], source[name] = value, env_name(name)
            if _is_repeatable(name):
                raw[name] = [part for part in value.split(os.pathsep) if part]
        if (value := given.get(name)) is not None:
            raw[name], source[name] = value, flag_name(name)
    for name in list(raw):
        if raw[name] == "" and _FIELDS[name].default is None:
            raw[name] = None  # an empty env var unsets an optional setting
    try:
        return msgspec.convert(raw, Settings, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        # "... - at `$.weights_root[1]`": the setting is the name before any index.
        field = (
            re.split(r"[\[`]", message.rsplit("$.", 1)[-1], maxsplit=1)[0]
            if "$." in message
            else None
        )
        where = source.get(field, flag_name(field)) if field else "settings"
        reason = message.split(" - at ", maxsplit=1)[0]
        if field in raw and field not in SECRET_FIELDS:
            reason = f"{reason} (got {raw[field]!r})"
        raise ConfigError(f"invalid {where}: {reason}") from None
