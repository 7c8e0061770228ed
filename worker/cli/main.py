"""Command line: `serve` the worker, `submit` jobs, read `results`, `payloads gc`, `tiny-model`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Final

import msgspec

from schemas import (
    RECIPES,
    Completed,
    Failed,
    Job,
    Part,
    ResultAssembler,
    SchemaError,
    decode_job,
    decode_result,
    encode,
)
from worker import __version__
from worker.answering.encoder import encode_result
from worker.cli.control import add_control_parsers, run_control, run_status
from worker.cli.replay_out import ReplayWriter
from worker.cli.routing_view import RoutingView
from worker.client.fleet import aiokafka_quiet, start_clients
from worker.core.config import Settings, add_settings_arguments, settings_from
from worker.core.errors import BrokerError, ConfigError, FatalError, WorkerError

__all__ = ["main"]

logger = logging.getLogger("worker")

CONNECTION_SETTINGS: Final = (
    "bootstrap_servers",
    "security_protocol",
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_key_password",
)

EXIT_OK: Final = 0
EXIT_FATAL: Final = 1
EXIT_USAGE: Final = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-kafka-worker",
        description="Kafka generation jobs in, vLLM completions with MoE routed experts out.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the worker",
        description=(
            "Consume jobs, generate, publish results, commit answered offsets. Every flag also "
            "reads an env var (VKW_<FLAG>). vLLM engine arguments go after `--`, exactly as for "
            "`vllm serve` (e.g. `-- --model DIR --enforce-eager`); `serve --engine vllm -- --help` "
            "lists them."
        ),
    )
    add_settings_arguments(serve)

    submit = commands.add_parser(
        "submit",
        help="produce jobs from a JSON-lines file",
        description=(
            "Validate every line as a job (filling a missing job_id), "
            "then produce them, keyed by job_id."
        ),
    )
    submit.add_argument("file", type=Path, help="JSON lines, one job per line ('-' for stdin)")
    submit.add_argument("--no-progress", action="store_true", help="no progress bar")
    submit.add_argument(
        "--wait",
        action="store_true",
        help="wait for every result (reassembled, deduplicated, retried) and print them",
    )
    submit.add_argument(
        "--timeout-s", type=float, default=600.0, help="with --wait: longest wait per job"
    )
    submit.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="with --wait: resubmissions of retryable failures",
    )
    submit.add_argument("--out", type=Path, help="with --wait: write every result as a JSON line")
    add_settings_arguments(
        submit,
        (*CONNECTION_SETTINGS, "jobs_topic", "results_topic", "max_result_bytes", "payload_store"),
    )

    results = commands.add_parser(
        "results",
        help="read and summarise results",
        description="Read results from the beginning of the results topic and summarise each one.",
    )
    results.add_argument("--follow", action="store_true", help="keep reading new results")
    results.add_argument(
        "--out",
        type=Path,
        help="also write every result as a JSON line here (with --replay: the .npz file)",
    )
    results.add_argument("--max", type=int, default=None, help="stop after this many results")
    results.add_argument("--quiet", action="store_true", help="no per-result lines, only the total")
    results.add_argument(
        "--raw",
        action="store_true",
        help="one line per record, parts of split results as they are (default: reassembled)",
    )
    results.add_argument(
        "--replay",
        metavar="RECIPE",
        choices=sorted(RECIPES),
        help=(
            "write each completed job's replay arrays in this trainer's layout to --out as "
            f".npz, one entry <job_id>/<index> per completion ({', '.join(sorted(RECIPES))})"
        ),
    )
    results.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="with --replay: the model's expert count, for records that do not carry it",
    )
    results.add_argument(
        "--routing",
        action="store_true",
        help=(
            "check every completion's routed experts (repeated ids within a top-k, all-zero "
            "layers, rows that do not match the tokens) and print the load per layer"
        ),
    )
    results.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="with the --routing checks, draw the expert load per layer as a heatmap (needs "
        "the plot extra)",
    )
    add_settings_arguments(
        results, (*CONNECTION_SETTINGS, "results_topic", "max_result_bytes", "payload_store")
    )

    payloads = commands.add_parser(
        "payloads",
        help="manage the payload store",
        description="The payload store holds routed experts too large for a record.",
    )
    payload_commands = payloads.add_subparsers(dest="payloads_command", required=True)
    gc_parser = payload_commands.add_parser(
        "gc",
        help="remove old payloads",
        description=(
            "Remove payloads (and temporary files a crash left) written longer ago than "
            "--older-than. Records naming them can no longer be resolved: keep them for as long "
            "as a trainer may still read their results."
        ),
    )
    gc_parser.add_argument(
        "--older-than", required=True, metavar="DURATION", help="like 90s, 30m, 12h or 7d"
    )
    add_settings_arguments(gc_parser, ("payload_store", "log_level"))

    add_control_parsers(commands, CONNECTION_SETTINGS)

    tiny = commands.add_parser(
        "tiny-model",
        help="write a tiny random-weight MoE model for tests and the demo",
        description=(
            "Write a random-weight Qwen3-MoE (4 layers, one dense, 8 experts, top-2) "
            "and a byte-level BPE tokenizer; nothing is downloaded."
        ),
    )
    tiny.add_argument("dir", type=Path, help="output directory")
    tiny.add_argument(
        "--seed", type=int, default=0, help="weights and tokenizer are a function of it"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `vllm-kafka-worker` and `python -m worker`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, engine_args = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    try:
        if args.command == "tiny-model":
            return _tiny_model(args.dir, args.seed)
        settings = settings_from(args)
        if args.command == "payloads":
            return _payloads_gc(settings, args.older_than)
        if args.command == "control":
            return asyncio.run(run_control(args, settings))
        if args.command == "status":
            return asyncio.run(run_status(args, settings))
        logging.basicConfig(
            level=settings.log_level,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        if args.command == "serve":
            return asyncio.run(_serve(settings, engine_args))
        if args.command == "submit":
            if args.wait:
                return asyncio.run(_submit_and_wait(settings, args))
            return asyncio.run(_submit(settings, args.file, progress=not args.no_progress))
        replay = _replay_writer(args, settings)
        routing = _routing_view(args, settings)
        return asyncio.run(
            _results(
                settings,
                follow=args.follow,
                out=None if replay is not None else args.out,
                limit=args.max,
                quiet=args.quiet,
                raw=args.raw,
                replay=replay,
                routing=routing,
            )
        )
    except ConfigError as exc:
        print(f"vllm-kafka-worker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (WorkerError, OSError) as exc:
        print(f"vllm-kafka-worker: error: {exc}", file=sys.stderr)
        return EXIT_FATAL
    except KeyboardInterrupt:
        return 130


def _tiny_model(out_dir: Path, seed: int) -> int:
    from worker.dev.tiny_model import build_tiny_model  # noqa: PLC0415 - needs torch; keep --help fast

    path = build_tiny_model(out_dir, seed=seed)
    print(path)
    return EXIT_OK


async def _serve(settings: Settings, engine_args: list[str]) -> int:
    import prometheus_client as prom  # noqa: PLC0415
    from aiokafka.errors import KafkaError  # noqa: PLC0415

    from worker.build import build_engine, build_worker, tune_gc_for_serving  # noqa: PLC0415
    from worker.core.kafka import create_topics  # noqa: PLC0415
    from worker.core.metrics import Metrics, MetricsServer  # noqa: PLC0415

    metrics = Metrics()
    server: MetricsServer | None = None
    if settings.metrics_port is not None:
        # Before the engine: /healthz answers while the model loads. The process's default
        # registry rides along: vLLM's own metrics (batch sizes, token counts, latencies) and
        # the process's CPU and memory, on the one endpoint an operator scrapes.
        server = MetricsServer(
            metrics, settings.metrics_host, settings.metrics_port, also=(prom.REGISTRY,)
        )
        server.start()
    try:
        engine = build_engine(settings, engine_args)  # bad arguments fail before Kafka
        if settings.create_topics:
            await create_topics(settings)
        start = await _start_on_the_fleets_checkpoint(settings, engine_args)
        if start.engine is not None:
            settings, engine = start.settings, start.engine
        try:
            service = await build_worker(
                settings,
                engine,
                metrics=metrics,
                on_serving=tune_gc_for_serving,
                built_on=start.built_on,
                passed_over=start.passed_over,
                owns_engine=start.engine is None,
            )
            if server is not None:
                server.is_ready = lambda: service.ready
            with _stop_on_signals(service):
                return await service.run()
        finally:
            if start.engine is not None:  # started here, so closed here, after the service
                await start.engine.close()
    except KafkaError as exc:
        raise BrokerError(f"Kafka at {settings.bootstrap_servers}: {exc!r}") from exc
    finally:
        if server is not None:
            server.stop()


@dataclasses.dataclass
class _Start:
    """What a worker joining a fleet starts on: an engine already started on the fleet's
    checkpoint (None: the configured one, started by the service), the update it came from,
    and the fleet's newer checkpoints that did not start, with why."""

    settings: Settings
    engine: Any = None
    built_on: str | None = None
    passed_over: dict[str, str] = dataclasses.field(default_factory=dict)


async def _start_on_the_fleets_checkpoint(settings: Settings, engine_args: list[str]) -> _Start:
    """A vLLM worker joining a fleet that moved to a newer checkpoint builds its engine on
    that one (and version) directly: one engine build instead of two. A checkpoint the fleet
    applied that no longer starts an engine (cut short since, still being written) is passed
    over, loudly, for the next older one the fleet applied, then the configured one."""
    start = _Start(settings)
    if settings.engine != "vllm":
        return start
    from worker.build import build_engine  # noqa: PLC0415
    from worker.control.catch_up import checkpoints_to_start_on  # noqa: PLC0415
    from worker.engines.vllm_weights import model_of, with_model  # noqa: PLC0415

    model = model_of(engine_args)
    candidates = await checkpoints_to_start_on(settings, None if model is None else Path(model))
    for candidate in candidates:
        update = candidate.update
        logger.info(
            "the control topic names %s (version %d, command %s): building the engine on it",
            candidate.path,
            update.version,
            update.command_id,
        )
        moved = msgspec.structs.replace(settings, weight_version=update.version)
        engine = build_engine(moved, with_model(engine_args, candidate.path))
        try:
            await engine.start()
        except FatalError as exc:
            logger.error(  # noqa: TRY400 - vLLM has logged the traceback; this says what follows
                "the fleet's checkpoint %s (version %d, command %s) does not start an engine "
                "here: %s; falling back to %s",
                candidate.path,
                update.version,
                update.command_id,
                exc,
                "the next older one the fleet applied"
                if candidate is not candidates[-1]
                else f"the configured checkpoint {model} (version {settings.weight_version})",
            )
            start.passed_over[update.command_id] = str(exc)[:500]
            await engine.close()
            continue
        start.settings, start.engine, start.built_on = moved, engine, update.command_id
        return start
    return start


@contextlib.contextmanager
def _stop_on_signals(worker: Any) -> Iterator[None]:
    """SIGTERM or SIGINT: the worker drains; a second signal exits at once."""
    loop = asyncio.get_running_loop()
    received = 0

    def on_signal(signum: int) -> None:
        nonlocal received
        received += 1
        if received > 1:
            logger.warning(
                "second signal %s: exiting now; unanswered jobs will be redelivered", signum
            )
            os._exit(128 + signum)
        logger.info("signal %s: draining", signum)
        worker.request_stop()

    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def _read_jobs(path: Path) -> list[Job]:
    """Validate every line first, so a bad file produces nothing and names its bad line."""
    stream: IO[str]
    with contextlib.ExitStack() as stack:
        stream = sys.stdin if str(path) == "-" else stack.enter_context(path.open(encoding="utf-8"))
        jobs: list[Job] = []
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                raw = msgspec.json.decode(line)
                if isinstance(raw, dict) and not raw.get("job_id"):
                    raw["job_id"] = str(uuid.uuid4())
                job = decode_job(encode(raw))
            except (msgspec.DecodeError, SchemaError) as exc:
                raise ConfigError(f"{path}:{number}: {exc}") from None
            jobs.append(job)
    return jobs


async def _submit(settings: Settings, path: Path, *, progress: bool) -> int:
    from tqdm import tqdm  # noqa: PLC0415

    from worker.core.kafka import make_producer  # noqa: PLC0415

    try:
        jobs = _read_jobs(path)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
    producer = make_producer(settings, linger_ms=20)
    await start_clients(
        [producer], settings.bootstrap_servers, f"writing {settings.jobs_topic}", quiet=True
    )
    try:
        bar = tqdm(total=len(jobs), unit="job", disable=not progress, file=sys.stderr)
        deliveries = []
        for job in jobs:
            # Keyed by session when the job has one: its conversation's turns share a worker.
            delivery = await producer.send(
                settings.jobs_topic, value=encode(job), key=job.record_key
            )
            delivery.add_done_callback(lambda _: bar.update())
            deliveries.append(delivery)
        await asyncio.gather(*deliveries)
        bar.close()
    finally:
        await producer.stop()
    for job in jobs:
        print(job.job_id)
    print(f"submitted {len(jobs)} jobs to {settings.jobs_topic}", file=sys.stderr)
    return EXIT_OK


def _payloads_gc(settings: Settings, older_than: str) -> int:
    from worker.answering.payload_store import open_payload_store, parse_duration  # noqa: PLC0415

    if settings.payload_store is None:
        raise ConfigError("payloads gc needs --payload-store (or VKW_PAYLOAD_STORE)")
    age_s = parse_duration(older_than)
    store = open_payload_store(settings.payload_store)
    if not store.root.is_dir():
        raise ConfigError(f"--payload-store {settings.payload_store}: no directory {store.root}")
    removed, freed = store.gc(age_s)
    print(f"removed {removed} payloads ({freed} bytes) older than {older_than} from {store.uri}")
    return EXIT_OK


async def _submit_and_wait(settings: Settings, args: argparse.Namespace) -> int:
    """Submit through the rollout client and print each result as it is answered."""
    from tqdm import tqdm  # noqa: PLC0415

    from worker.client.rollout import RolloutClient, RolloutError  # noqa: PLC0415
    from worker.core.kafka import client_kwargs  # noqa: PLC0415

    try:
        jobs = _read_jobs(args.file)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{args.file}: not UTF-8 text: {exc}") from None
    if args.timeout_s <= 0 or args.max_retries < 0:
        raise ConfigError("--timeout-s must be > 0 and --max-retries >= 0")
    bar = tqdm(total=len(jobs), unit="result", disable=args.no_progress, file=sys.stderr)
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(args.out.open("wb")) if args.out is not None else None
        # Connected as every other command is: the security flags reach the client.
        connection = client_kwargs(settings)
        client = RolloutClient(
            bootstrap_servers=connection.pop("bootstrap_servers"),
            **connection,
            jobs_topic=settings.jobs_topic,
            results_topic=settings.results_topic,
            timeout_s=args.timeout_s,
            max_retries=args.max_retries,
            payload_root=settings.payload_store,
            on_progress=lambda done, _: _advance(bar, done),
        )
        try:
            with aiokafka_quiet():  # an unreachable broker is said in one line, below
                await client.start()
            try:
                results = await client.generate(jobs)
            finally:
                await client.close()
        except RolloutError as exc:
            bar.close()
            raise WorkerError(str(exc)) from None
        bar.close()
        for result in results:
            print(summarize(result))
            if sink is not None:
                sink.write(encode_result(result) + b"\n")
    failed = sum(isinstance(r, Failed) for r in results)
    print(f"{len(results) - failed} completed, {failed} failed", file=sys.stderr)
    return EXIT_FATAL if failed else EXIT_OK


def _advance(bar: Any, done: int) -> None:
    bar.update(done - bar.n)


def summarize(result: Completed | Failed) -> str:
    """One line per result (or part), with a routed-experts summary per completion."""
    if isinstance(result, Failed):
        return f"{result.job_id} failed {result.error.code}: {result.error.detail}"
    parts = [f"{result.job_id} completed prompt={result.prompt_token_count}"]
    if isinstance(result.cached_prompt_tokens, int):
        parts.append(f"cached={result.cached_prompt_tokens}")
    if isinstance(result.weight_version, int):
        parts.append(f"version={result.weight_version}")
    if isinstance(result.part, Part):
        p = result.part
        parts.append(f"part={p.index + 1}/{p.count} attempt={p.attempt}")
    for c in result.completions:
        text = f"[{c.index}] tokens={len(c.token_ids)} finish={c.finish_reason}"
        if c.routed_experts is not None:
            re_ = c.routed_experts
            rows, layers, top_k = re_.shape
            text += (
                f" routed_experts={rows}x{layers}x{top_k} {re_.dtype} start={re_.start}"
                f" positions=[{re_.start},{re_.end})"
            )
            if isinstance(re_.uri, str):
                text += f" payload={re_.uri}"
        parts.append(text)
    return " ".join(parts)


class _ResultsReport:
    """What `results` prints and writes: whole results (reassembled), or every record (`raw`)."""

    def __init__(
        self,
        *,
        quiet: bool,
        raw: bool,
        sink: IO[bytes] | None,
        replay: ReplayWriter | None,
        routing: RoutingView | None = None,
    ) -> None:
        self.counts = {"completed": 0, "failed": 0, "undecodable": 0}
        self.shown = 0
        self._quiet = quiet
        self._raw = raw
        self._sink = sink
        self._replay = replay
        self._routing = routing
        self._assembler = ResultAssembler()

    def take(self, record: Any) -> None:
        """One record from the results topic."""
        try:
            result = decode_result(record.value or b"")
            shown = result if self._raw else self._assembler.add(result)
        except SchemaError as exc:
            self.counts["undecodable"] += 1
            where = f"{record.topic}-{record.partition}@{record.offset}"
            print(f"undecodable result at {where}: {exc}", file=sys.stderr)
            return
        if shown is None:  # a part, or a duplicate
            return
        self.shown += 1
        self.counts["completed" if isinstance(shown, Completed) else "failed"] += 1
        if not self._quiet:
            print(summarize(shown))
        if self._sink is not None:
            value = record.value if self._raw else encode_result(shown)
            self._sink.write((value or b"") + b"\n")
        if self._replay is not None and isinstance(shown, Completed):
            self._replay.add(shown)
        if self._routing is not None and isinstance(shown, Completed):
            self._routing.add(shown)

    def finish(self) -> int:
        """Print the totals (and write the replay arrays); returns the exit status."""
        incomplete = self._assembler.incomplete()
        for attempt in incomplete:
            print(
                f"{attempt.job_id} incomplete: parts {attempt.received} of {attempt.count} "
                f"(attempt {attempt.attempt})",
                file=sys.stderr,
            )
        c = self.counts
        tail = "" if self._raw else f", {len({a.job_id for a in incomplete})} incomplete"
        print(
            f"{c['completed']} completed, {c['failed']} failed, {c['undecodable']} undecodable"
            + tail,
            file=sys.stderr,
        )
        replay_refused = self._replay is not None and self._replay.finish()
        routing_flagged = self._routing is not None and self._routing.finish(sys.stdout, sys.stderr)
        return EXIT_FATAL if replay_refused or routing_flagged else EXIT_OK


async def _results(
    settings: Settings,
    *,
    follow: bool,
    out: Path | None,
    limit: int | None,
    quiet: bool,
    raw: bool,
    replay: ReplayWriter | None = None,
    routing: RoutingView | None = None,
) -> int:
    from aiokafka import TopicPartition  # noqa: PLC0415

    from worker.core.kafka import make_consumer  # noqa: PLC0415

    # No group: a reader of results assigns partitions itself and commits nothing.
    consumer = make_consumer(settings, group_id=None, group_instance_id=None)
    await start_clients(
        [consumer], settings.bootstrap_servers, f"reading {settings.results_topic}", quiet=True
    )
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(out.open("wb")) if out is not None else None
        report = _ResultsReport(quiet=quiet, raw=raw, sink=sink, replay=replay, routing=routing)
        try:
            partitions = consumer.partitions_for_topic(settings.results_topic) or set()
            if not partitions:
                raise BrokerError(f"topic {settings.results_topic} does not exist")
            tps = [TopicPartition(settings.results_topic, p) for p in sorted(partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            while limit is None or report.shown < limit:
                batch = await consumer.getmany(timeout_ms=500)
                for record in (r for records in batch.values() for r in records):
                    report.take(record)
                    if limit is not None and report.shown >= limit:
                        break
                if not follow:
                    positions = {tp: await consumer.position(tp) for tp in tps}
                    if all(positions[tp] >= end[tp] for tp in tps):
                        break
        finally:
            await consumer.stop()
    return report.finish()


def _replay_writer(args: argparse.Namespace, settings: Settings) -> ReplayWriter | None:
    """`results --replay`'s writer, once its flags are known to fit together."""
    if args.replay is None:
        if args.num_experts is not None:
            raise ConfigError("--num-experts is for --replay")
        return None
    if args.out is None:
        raise ConfigError("--replay writes its arrays to --out FILE.npz: pass --out")
    if args.raw:
        raise ConfigError("--replay takes whole results: leave out --raw")
    if args.follow:
        raise ConfigError("--replay writes its file once all results are read: leave out --follow")
    return ReplayWriter(args.replay, args.out, args.num_experts, settings.payload_store)


def _routing_view(args: argparse.Namespace, settings: Settings) -> RoutingView | None:
    """`results --routing` / `--plot`'s view, once its flags are known to fit together (and
    matplotlib is there for `--plot`, before any record is read)."""
    if not args.routing and args.plot is None:
        return None
    if args.raw:
        raise ConfigError("--routing and --plot take whole results: leave out --raw")
    if args.follow:
        raise ConfigError(
            "--routing and --plot report once all results are read: leave out --follow"
        )
    return RoutingView(args.plot, settings.payload_store)
