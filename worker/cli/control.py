"""`vllm-kafka-worker control ...` and `status`: the fleet from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

import msgspec
from aiokafka.errors import KafkaError

from schemas import (
    Abort,
    Command,
    CommandAck,
    Pause,
    ResetPrefixCache,
    Resume,
    Target,
    UpdateWeights,
    WorkerStatus,
)
from worker.client.fleet import Fleet, new_command_id
from worker.core.config import Settings, add_settings_arguments
from worker.core.errors import ConfigError

__all__ = ["add_control_parsers", "run_control", "run_status"]

FLEET_SETTINGS: Final = ("control_topic", "status_topic", "group_id", "control_hmac_key")

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


def add_control_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    connection: tuple[str, ...],
) -> None:
    control = commands.add_parser(
        "control",
        help="steer the fleet: pause, resume, update weights, abort jobs",
        description=(
            "Send one command to the control topic, for the workers of --group-id (or those "
            "named by --target-worker). With --wait, exit 0 once every live worker of the "
            "target has acknowledged it ok, 1 if any failed or did not answer in time."
        ),
    )
    kinds = control.add_subparsers(dest="control_command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--wait", action="store_true", help="wait for the acknowledgements")
    common.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="how long the whole command may take, --wait included (default 600)",
    )
    common.add_argument(
        "--target-worker",
        action="append",
        metavar="WORKER_ID",
        help="only these workers (repeatable); default: every worker of --group-id",
    )
    common.add_argument("--command-id", help="the command's id (default: a new one)")
    add_settings_arguments(common, (*connection, *FLEET_SETTINGS))

    pause = kinds.add_parser("pause", parents=[common], help="start no new job")
    pause.add_argument("--mode", choices=["abort", "wait", "keep"], default="wait")
    kinds.add_parser("resume", parents=[common], help="start jobs again")
    update = kinds.add_parser(
        "update-weights", parents=[common], help="serve new weights, without a restart"
    )
    update.add_argument("path", nargs="?", help="checkpoint directory the workers can read")
    update.add_argument("--version", type=int, required=True, help="the new weight version")
    update.add_argument(
        "--on-inflight", choices=["keep", "wait", "restart", "abort"], default="wait"
    )
    update.add_argument("--backend", choices=["checkpoint", "nccl", "ipc"], default="checkpoint")
    update.add_argument("--init-info", help="weight-transfer init_info (JSON object)")
    update.add_argument("--update-info", help="weight-transfer update_info (JSON object)")
    update.add_argument(
        "--force",
        action="store_true",
        help="roll back: workers refuse a version older than the one they serve without it",
    )
    abort = kinds.add_parser("abort", parents=[common], help="abort matching jobs in flight")
    abort.add_argument("--job-id", action="append", help="a job to abort (repeatable)")
    abort.add_argument(
        "--metadata", action="append", metavar="KEY=VALUE", help="match on metadata (repeatable)"
    )
    kinds.add_parser("reset-prefix-cache", parents=[common], help="drop the prefix cache")

    status = commands.add_parser(
        "status", help="one line per live worker", description="The fleet's latest heartbeats."
    )
    status.add_argument("--all-groups", action="store_true", help="not only --group-id")
    status.add_argument(
        "--timeout-s", type=float, default=60.0, help="how long reading may take (default 60)"
    )
    add_settings_arguments(status, (*connection, *FLEET_SETTINGS))


def build_command(args: argparse.Namespace, settings: Settings) -> Command:
    """The command the arguments describe; ConfigError (exit 2) for what cannot be one."""
    command_id = args.command_id or new_command_id()
    target = (
        Target(workers=list(args.target_worker))
        if args.target_worker
        else Target(group=settings.group_id)
    )
    common: dict[str, Any] = {"command_id": command_id, "target": target, "issued_at": time.time()}
    try:
        match args.control_command:
            case "pause":
                return Pause(mode=args.mode, **common)
            case "resume":
                return Resume(**common)
            case "reset-prefix-cache":
                return ResetPrefixCache(**common)
            case "abort":
                metadata = _pairs(args.metadata) if args.metadata else None
                return msgspec.convert(
                    {"job_ids": args.job_id, "metadata": metadata, **common},
                    Abort,
                )
            case _:
                return msgspec.convert(
                    {
                        "version": args.version,
                        "path": args.path,
                        "on_inflight": args.on_inflight,
                        "backend": args.backend,
                        "init_info": _json_object(args.init_info, "--init-info"),
                        "update_info": _json_object(args.update_info, "--update-info"),
                        "force": args.force,
                        **common,
                    },
                    UpdateWeights,
                )
    except msgspec.ValidationError as exc:
        raise ConfigError(f"control {args.control_command}: {exc}") from None


async def run_control(args: argparse.Namespace, settings: Settings) -> int:
    """Send the command; with --wait, collect the acknowledgements. `--timeout-s` bounds the
    whole of it: a status partition that cannot be read ends it with exit 1, not a hang."""
    command = build_command(args, settings)
    deadline: float = time.monotonic() + args.timeout_s

    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    sent = False
    try:
        async with Fleet.from_settings(settings, quiet_start=True) as fleet:
            live = await fleet.live_workers(command.target, timeout_s=left()) if args.wait else {}
            since = await fleet.status_end(timeout_s=left()) if args.wait else {}
            await fleet.send(command, timeout_s=left())
            sent = True
            print(f"sent {command.command_id} to {settings.control_topic}", file=sys.stderr)
            if not args.wait:
                print(command.command_id)
                return EXIT_OK
            if not live:
                print("no live worker of the target to wait for", file=sys.stderr)
                return EXIT_FAILED
            acks = await fleet.acks(command.command_id, live, since, left())
    except (TimeoutError, KafkaError) as exc:
        print(f"{exc} ({'sent' if sent else 'not sent'})", file=sys.stderr)
        return EXIT_FAILED
    print(ack_table(sorted(live), acks))
    failed = [w for w in live if w not in acks or acks[w].outcome != "ok"]
    return EXIT_FAILED if failed else EXIT_OK


def ack_table(workers: list[str], acks: dict[str, CommandAck]) -> str:
    rows: list[tuple[str, ...]] = [("worker", "outcome", "seconds", "version", "detail")]
    for worker in workers:
        ack = acks.get(worker)
        if ack is None:
            rows.append((worker, "no answer", "-", "-", ""))
        else:
            rows.append(
                (
                    worker,
                    ack.outcome,
                    f"{ack.duration_s:.2f}",
                    str(ack.weight_version),
                    ack.detail,
                )
            )
    return _table(rows)


async def run_status(args: argparse.Namespace, settings: Settings) -> int:
    target = None if args.all_groups else Target(group=settings.group_id)
    try:
        async with Fleet.from_settings(settings, quiet_start=True) as fleet:
            live = await fleet.live_workers(target, timeout_s=args.timeout_s)
    except (TimeoutError, KafkaError) as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_FAILED
    print(status_table(list(live.values())))
    return EXIT_OK


def status_table(statuses: list[WorkerStatus]) -> str:
    rows: list[tuple[str, ...]] = [
        (
            "worker",
            "group",
            "version",
            "paused",
            "in_flight",
            "lag",
            "healthy",
            "reload",
            "uptime_s",
            "needs_weights",
        )
    ]
    for s in sorted(statuses, key=lambda s: s.worker):
        rows.append(
            (
                s.worker,
                s.group,
                str(s.weight_version),
                "yes" if s.paused else "no",
                str(s.in_flight),
                "-" if s.lag is None else str(s.lag),
                "yes" if s.engine_healthy else "NO",
                "-" if s.weight_reload is None else s.weight_reload.mode,
                f"{s.uptime_s:.0f}",
                "YES" if s.needs_weights else "no",
            )
        )
    return _table(rows)


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--metadata {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _json_object(text: str | None, flag: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: expected a JSON object")
    return value
