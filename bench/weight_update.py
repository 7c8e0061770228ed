"""Benchmark: weight updates over the control topic, per `on_inflight` mode.

Run `python bench/weight_update.py [--jobs N] [--tokens N] [--mock-workers N] [--skip-vllm]`.
Uses $KAFKA_BOOTSTRAP_SERVERS when set, else starts a local noida-db broker.

1. The control path alone: a fleet of `--mock-workers` steered workers (mock engine, 5 ms a
   token) with jobs in flight; per mode, the time from producing the command to the last
   worker's acknowledgement.
2. Real vLLM (the tiny MoE, eager, no capture; two checkpoints of one architecture), for each
   way of taking a checkpoint (`--weight-reload auto`, which proves and picks in place, then
   `rebuild`): one steered worker with `--jobs` generations of `--tokens` in flight; per mode,
   the time from the command to the acknowledgement, the tokens generated and thrown away
   (`restart`), the tokens fed forward again to continue sequences (`keep` on a rebuilt
   engine; none in place) and the partial tokens handed back (`abort`). The baseline, measured
   in the same run, is what the update replaces: restarting the worker on the new checkpoint,
   timed from starting `python -m worker serve` to its first heartbeat (imports, engine start,
   control catch-up); the ratio is update time / that (goal in place: <= 0.02). A restart
   while the control topic names a newer checkpoint is timed the same way, to the first
   heartbeat on the new version (goal: <= 1.1 of the plain restart).

3. Reload speed (`--reload-gb`, default 1.0; `--reload-only` runs just this): a random MoE
   checkpoint of about that size (the tiny-model builder with larger sizes: 6 layers, hidden
   1024, 32 experts of 512, fp32), served by a vLLM engine without capture. Per in-place reload,
   the bytes of its safetensors over the seconds `vkw_reload_checkpoint` takes in vLLM's worker
   (GB/s), against reading the same files from the page cache with read(2) in the same run
   (best of three each, into a page-aligned buffer; the same read into a buffer 16 bytes off,
   as a bytearray's data is, runs at a third of that here and is shown beside), and the ratio
   (goal >= 0.5); the floor a reload cannot go under on vLLM's CPU MoE kernel (its prepack of
   the experts alone, as the reload calls it); then the check after it (every parameter
   finite, the probe) and a whole `update_weights` as the control plane runs it.

It prints figures and ratios; it never fails on them (exit code 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import mmap
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
from aiokafka import AIOKafkaProducer, TopicPartition

from schemas import (
    CommandAck,
    Failed,
    Job,
    SamplingSpec,
    UpdateWeights,
    WorkerStatus,
    decode_result,
    decode_status,
    encode,
)
from worker.build import Service, build_worker
from worker.core.config import Settings, settings_from
from worker.core.paced_consumer import PacedConsumer
from worker.dev.broker import env_or_local_broker, new_topics
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.protocol import ControllableEngine

MODES: Final = ("wait", "keep", "restart", "abort")
PROMPT: Final = list(range(11, 43))
IN_PLACE_GOAL: Final = 0.02
PENDING_RESTART_GOAL: Final = 1.1
RELOAD_READ_GOAL: Final = 0.5
READ_CHUNK: Final = 64 * 1024 * 1024
#: Where a bytearray's data starts past its allocation: the misaligned read shown for contrast.
MISALIGNED: Final = 16
#: Shard-sized outputs per shape the prepack floor writes in turn.
PACKED_OUTPUTS: Final = 64


class Fleet:
    """Topics of one benchmark fleet and readers of its status and results."""

    def __init__(self, bootstrap: str, weights_root: Path) -> None:
        self.bootstrap = bootstrap
        self.group = f"bench-{uuid.uuid4().hex[:8]}"
        #: Where the checkpoints the updates name are written (the workers load from it only).
        self.weights_root = weights_root

    async def create(self) -> Fleet:
        self.jobs, self.results, self.dlq, self.control, self.status = await new_topics(
            self.bootstrap, 5
        )
        return self

    def settings(self, worker_id: str) -> Settings:
        return settings_from(
            {
                "bootstrap_servers": self.bootstrap,
                "jobs_topic": self.jobs,
                "results_topic": self.results,
                "dead_letter_topic": self.dlq,
                "control_topic": self.control,
                "status_topic": self.status,
                "group_id": self.group,
                "worker_id": worker_id,
                "commit_interval_ms": 0,
                "poll_timeout_ms": 50,
                "status_interval_s": 1.0,
                "weights_root": [str(self.weights_root)],
            },
            {},
        )

    async def start(self, worker_id: str, engine: ControllableEngine) -> tuple[Service, Any]:
        service = await build_worker(self.settings(worker_id), engine)
        return service, asyncio.create_task(service.run())

    async def produce(self, topic: str, values: list[bytes]) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5)
        await producer.start()
        try:
            for value in values:
                await producer.send(topic, value=value)
            await producer.flush()
        finally:
            await producer.stop()

    async def read(self, topic: str, until: Any, timeout_s: float = 600) -> list[Any]:
        """Decoded records of `topic` from the start until `until(records)` holds."""
        consumer = PacedConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await consumer.start()
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        decode = decode_status if topic == self.status else decode_result
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        try:
            while not until(out):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{topic}: condition not met in {timeout_s}s")
                for records in (await consumer.getmany(timeout_ms=100)).values():
                    out += [(r.timestamp, decode(r.value)) for r in records]
            return out
        finally:
            await consumer.stop()


def acks_of(records: list[Any], command_id: str) -> list[tuple[int, CommandAck]]:
    return [(t, m) for t, m in records if isinstance(m, CommandAck) and m.command_id == command_id]


async def update(fleet: Fleet, version: int, path: Path, mode: str, workers: int) -> float:
    """Seconds from producing the command to the last worker's acknowledgement."""
    command = msgspec.convert(
        {"command_id": f"u{version}", "version": version, "path": str(path), "on_inflight": mode},
        UpdateWeights,
    )
    sent_ms = time.time() * 1000
    await fleet.produce(fleet.control, [encode(command)])
    records = await fleet.read(
        fleet.status, lambda r: len(acks_of(r, command.command_id)) >= workers
    )
    acks = acks_of(records, command.command_id)
    if any(ack.outcome != "ok" for _, ack in acks):
        raise RuntimeError(f"update failed: {[a for _, a in acks]}")
    return (max(t for t, _ in acks) - sent_ms) / 1000


def jobs(prefix: str, count: int, tokens: int) -> list[bytes]:
    return [
        encode(
            Job(
                job_id=f"{prefix}-{i}",
                prompt_token_ids=PROMPT,
                sampling=SamplingSpec(max_tokens=tokens, temperature=0.0, ignore_eos=True),
            )
        )
        for i in range(count)
    ]


def mock_checkpoint(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"name": name}))
    return path


async def control_path(bootstrap: str, workers: int, root: Path) -> None:
    fleet = await Fleet(bootstrap, root).create()
    running = [
        await fleet.start(
            f"mock-{i}",
            MockEngine(MockEngineSettings(per_token_latency_ms=5, num_layers=4, top_k=2)),
        )
        for i in range(workers)
    ]
    paths = [mock_checkpoint(root, "a"), mock_checkpoint(root, "b")]
    await asyncio.sleep(2.0)  # joined and heartbeating
    line = []
    for version, mode in enumerate(MODES, 1):
        await fleet.produce(fleet.jobs, jobs(f"m{version}", 4 * workers, 400))
        await asyncio.sleep(1.0)
        seconds = await update(fleet, version, paths[version % 2], mode, workers)
        line.append(f"{mode} {seconds * 1000:.0f} ms")
    print(f"control path, {workers} mock workers, command to last ack: " + ", ".join(line))
    for steered, task in running:
        steered.request_stop()
        await task


async def real_vllm(bootstrap: str, count: int, tokens: int, root: Path) -> None:
    from worker.dev.tiny_model import build_tiny_model  # noqa: PLC0415

    a, b = build_tiny_model(root / "a", seed=0), build_tiny_model(root / "b", seed=1)
    cold_s = await restart_seconds(bootstrap, b)
    print(f"baseline: a worker restarted on the new checkpoint serves after {cold_s:.1f} s")
    pending_s = await restart_seconds(bootstrap, a, pending=b)
    verdict = "meets" if pending_s <= PENDING_RESTART_GOAL * cold_s else "MISSES"
    print(
        f"a worker restarted on A while the control topic names B serves B after "
        f"{pending_s:.1f} s ({pending_s / cold_s:.2f} of a plain restart; {verdict} the goal "
        f"<= {PENDING_RESTART_GOAL})"
    )
    for reload in ("auto", "rebuild"):
        await updates_per_mode(
            bootstrap, (a, b), count=count, tokens=tokens, reload=reload, cold_s=cold_s
        )


async def updates_per_mode(
    bootstrap: str,
    checkpoints: tuple[Path, Path],
    *,
    count: int,
    tokens: int,
    reload: str,
    cold_s: float,
) -> None:
    from worker.engines.vllm_engine import build_vllm_engine  # noqa: PLC0415

    a, b = checkpoints
    engine = build_vllm_engine(engine_args_fast(a), weight_reload=reload)  # type: ignore[arg-type]
    fleet = await Fleet(bootstrap, a.parent).create()
    steered, task = await fleet.start("vllm-0", engine)
    # vLLM builds its engine on this event loop: a client connecting meanwhile times out, so
    # the readers wait until the worker serves.
    while not steered.ready:
        if task.done():
            raise RuntimeError(f"the worker stopped at start (status {task.result()})")
        await asyncio.sleep(0.2)
    chosen = engine.weight_reload
    print(f"--weight-reload {reload}: updates {chosen.mode} ({chosen.reason})")
    done = 0
    for version, mode in enumerate(MODES, 1):
        before_discarded = steered.steerable.tokens_discarded
        before_recomputed = steered.steerable.tokens_recomputed
        await fleet.produce(fleet.jobs, jobs(f"{reload}-v{version}", count, tokens))
        await asyncio.sleep(0.5)
        seconds = await update(fleet, version, a if version % 2 == 0 else b, mode, 1)
        done += count
        results = await fleet.read(fleet.results, lambda r, n=done: len(r) >= n)
        partial = sum(
            len(c.token_ids)
            for _, r in results[-count:]
            if isinstance(r, Failed) and not isinstance(r.partial, msgspec.UnsetType)
            for c in r.partial
        )
        goal = ""
        if mode == "wait":
            # `wait` lets the jobs in flight finish first: its time is theirs, not the load's.
            goal = "; waits for the jobs in flight to finish"
        elif chosen.mode == "in-place":
            goal = (
                f"; {'meets' if seconds <= IN_PLACE_GOAL * cold_s else 'MISSES'} <= {IN_PLACE_GOAL}"
            )
        print(
            f"  {mode:7s} command to ack {seconds:6.2f} s ({seconds / cold_s:.3f} of a fresh "
            f"start{goal}); tokens thrown away "
            f"{steered.steerable.tokens_discarded - before_discarded}, fed forward again "
            f"{steered.steerable.tokens_recomputed - before_recomputed}, handed back partial "
            f"{partial} (of {count} x {tokens} in flight)"
        )
    steered.request_stop()
    await task


async def restart_seconds(bootstrap: str, checkpoint: Path, pending: Path | None = None) -> float:
    """From starting a worker process on `checkpoint` to its first heartbeat; with `pending`,
    the control topic first names that checkpoint (version 1), and the clock stops at the
    first heartbeat on version 1."""
    fleet = await Fleet(bootstrap, checkpoint.parent).create()
    if pending is not None:
        command = UpdateWeights(command_id="pending", version=1, path=str(pending))
        await fleet.produce(fleet.control, [encode(command)])
    flags = {
        "bootstrap-servers": bootstrap,
        "jobs-topic": fleet.jobs,
        "results-topic": fleet.results,
        "dead-letter-topic": fleet.dlq,
        "control-topic": fleet.control,
        "status-topic": fleet.status,
        "group-id": fleet.group,
        "worker-id": "restarted",
        "weights-root": str(checkpoint.parent),
    }
    argv = [sys.executable, "-m", "worker", "serve"]
    for name, value in flags.items():
        argv += [f"--{name}", value]
    argv += ["--", *engine_args_fast(checkpoint)]
    version = 0 if pending is None else 1
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        await fleet.read(
            fleet.status,
            lambda r: any(
                isinstance(m, WorkerStatus) and m.weight_version == version for _, m in r
            ),
            timeout_s=600,
        )
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        await proc.wait()


def large_spec(gigabytes: float) -> Any:
    """The tiny model's shape, widened so that its experts weigh about `gigabytes` (fp32)."""
    from worker.dev.tiny_model import TinyModelSpec  # noqa: PLC0415

    hidden, expert, layers, dense = 1024, 512, 6, (1,)
    per_expert = 3 * hidden * expert * 4
    experts = max(2, round(gigabytes * 1e9 / (per_expert * (layers - len(dense)))))
    return TinyModelSpec(
        num_layers=layers,
        dense_layers=dense,
        num_experts=experts,
        top_k=2,
        hidden_size=hidden,
        num_attention_heads=8,  # head_dim 128, which vLLM's CPU attention takes
        num_key_value_heads=4,
        intermediate_size=2 * hidden,
        moe_intermediate_size=expert,
    )


def read_seconds(files: list[Path], *, offset: int = 0) -> float:
    """Seconds to read `files` with read(2) into one reused buffer `offset` bytes past a page
    boundary: the page cache's cost of the bytes. The offset is there to show what it costs:
    measured here, 8-10 GB/s into a page-aligned buffer (or 64 bytes past one), 2.6 GB/s at
    16 bytes past one, which is where a bytearray's data starts (its allocation's header);
    the kernel's copy out of the page cache is that much slower to a destination off a cache
    line."""
    buffer = mmap.mmap(-1, READ_CHUNK + offset)
    view = memoryview(buffer)[offset:]
    try:
        t0 = time.perf_counter()
        for path in files:
            with path.open("rb", buffering=0) as f:
                while f.readinto(view):
                    pass
        return time.perf_counter() - t0
    finally:
        view.release()
        buffer.close()


def safetensors_seconds(files: list[Path]) -> float:
    """Seconds to read every tensor of `files` the way vLLM's loader iterates them."""
    from safetensors import safe_open  # noqa: PLC0415

    t0 = time.perf_counter()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                # get_tensor maps the file; the clone reads the bytes, as a load copies them.
                f.get_tensor(name).clone()
    return time.perf_counter() - t0


def prepack_seconds(files: list[Path]) -> tuple[float, int]:
    """Seconds vLLM's CPU MoE kernel takes to prepack the experts of the checkpoint `files`
    straight from its mapped tensors, one shard (an expert's w1, w3 or w2) a call as the direct
    reload runs it, on one thread (vLLM binds its model worker to one core), with the ISA the
    kernel takes on a CPU without AMX ("vec"): reading the experts' bytes out of the page cache
    and writing them in the kernel's layout, the least a reload of them can do on this kernel.
    Also the experts' bytes."""
    import torch  # noqa: PLC0415
    import vllm._custom_ops  # noqa: F401, PLC0415 - registers torch.ops._C
    from safetensors import safe_open  # noqa: PLC0415

    # Outputs for PACKED_OUTPUTS shards of each shape, written in turn: memory far past the
    # caches, as a reload's writes are.
    packed: dict[tuple[int, ...], list[Any]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best, size = float("inf"), 0
        for _ in range(3):
            t0, size, written = time.perf_counter(), 0, collections.Counter[tuple[int, ...]]()
            for path in files:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                        if ".experts." not in name:
                            continue
                        shard = f.get_tensor(name).unsqueeze(0)
                        shape = tuple(shard.shape)
                        outs = packed.setdefault(shape, [])
                        if len(outs) < PACKED_OUTPUTS:
                            outs.append(torch.empty_like(shard))
                        torch.ops._C.prepack_moe_weight(
                            shard, outs[written[shape] % len(outs)], "vec"
                        )
                        written[shape] += 1
                        size += shard.numel() * shard.element_size()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return best, size


@dataclass
class _ReloadTimes:
    """Seconds per checkpoint of the reload bench, in the order loaded."""

    reads: list[float] = field(default_factory=list)
    misaligned_reads: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    reloads: list[float] = field(default_factory=list)
    checks: list[float] = field(default_factory=list)
    probes: list[float] = field(default_factory=list)
    how: dict[str, Any] = field(default_factory=dict)


async def _time_reloads(engine: Any, paths: tuple[Path, ...]) -> _ReloadTimes:
    """Each of `paths` read from the page cache (both ways), read as vLLM's loader does,
    reloaded in place, checked and probed."""
    from worker.engines.vllm_reload import nonfinite_parameters, reload_in_place  # noqa: PLC0415

    llm, timed = engine.async_llm, _ReloadTimes()
    for path in paths:
        shards = sorted(path.glob("*.safetensors"))
        read_seconds(shards)  # into the page cache
        timed.reads.append(read_seconds(shards))
        timed.misaligned_reads.append(read_seconds(shards, offset=MISALIGNED))
        timed.loads.append(safetensors_seconds(shards))
        t0 = time.perf_counter()
        timed.how = await reload_in_place(llm, path)
        timed.reloads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await nonfinite_parameters(llm)
        timed.checks.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        problem = await engine.weights_problem()
        timed.probes.append(time.perf_counter() - t0)
        if problem is not None:
            raise RuntimeError(f"the reloaded weights failed the check: {problem}")
    return timed


async def reload_speed(root: Path, gigabytes: float) -> None:
    from worker.dev.tiny_model import build_tiny_model  # noqa: PLC0415
    from worker.engines.vllm_engine import build_vllm_engine  # noqa: PLC0415

    spec = large_spec(gigabytes)
    t0 = time.perf_counter()
    a = build_tiny_model(root / "large-a", seed=0, spec=spec)
    b = build_tiny_model(root / "large-b", seed=1, spec=spec)
    files = sorted(a.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(
        f"reload speed: {size / 1e9:.2f} GB checkpoints ({spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.num_experts} experts of {spec.moe_intermediate_size}, fp32) "
        f"built in {time.perf_counter() - t0:.0f} s"
    )
    engine = build_vllm_engine(engine_args_fast(a), weight_reload="in-place")
    t0 = time.perf_counter()
    await engine.start()
    print(f"  engine on it started in {time.perf_counter() - t0:.0f} s")
    try:
        timed = await _time_reloads(engine, (b, a, b))
        read_s = min(timed.reads)
        read_gbs, reload_gbs = size / read_s / 1e9, size / min(timed.reloads) / 1e9
        misaligned_gbs = size / min(timed.misaligned_reads) / 1e9
        load_s = min(timed.loads)
        ratio = reload_gbs / read_gbs
        verdict = "meets" if ratio >= RELOAD_READ_GOAL else "MISSES"
        print(
            f"  page-cache read (read(2), page-aligned buffer) {read_gbs:.2f} GB/s "
            f"({read_s:.2f} s; {misaligned_gbs:.2f} GB/s into a buffer {MISALIGNED} bytes past "
            f"a page, as a bytearray's data is); "
            f"in-place reload {reload_gbs:.2f} GB/s ({min(timed.reloads):.2f} s; all: "
            f"{', '.join(f'{r:.2f}' for r in timed.reloads)} s); ratio {ratio:.2f} ({verdict} "
            f"the goal >= {RELOAD_READ_GOAL}; against the misaligned read "
            f"{reload_gbs / misaligned_gbs:.2f})"
        )
        print(
            f"  reload path: {timed.how['path']} ({timed.how['moe_layers']} MoE layers prepared"
            f"{'; ' + timed.how['why'] if timed.how['why'] else ''})"
        )
        print(
            f"  reading the tensors as vLLM's loader does (safetensors, mmap, each tensor copied "
            f"out): {size / load_s / 1e9:.2f} GB/s ({load_s:.2f} s)"
        )
        packing, expert_bytes = prepack_seconds(files)
        print(
            f"  vLLM's CPU MoE prepack alone, the experts' {expert_bytes / 1e9:.2f} GB straight "
            f"from the mapped checkpoint, one shard a call on one thread as the reload runs it: "
            f"{packing:.2f} s "
            f"({expert_bytes / packing / 1e9:.2f} GB/s); a reload that does only that takes "
            f"{packing / read_s:.1f}x the page-cache read, a ratio of at most "
            f"{read_s / packing:.2f}"
        )
        print(
            f"  check after each reload: parameters finite {min(timed.checks):.2f} s, probe "
            f"{min(timed.probes):.2f} s"
        )
        t0 = time.perf_counter()
        await engine.load_weights(str(a), 9)
        whole = time.perf_counter() - t0
        print(
            f"  a whole in-place update (bytes checked, loaded, checked, probed): {whole:.2f} s, "
            f"{size / whole / 1e9:.2f} GB/s"
        )
    finally:
        await engine.close()


def engine_args_fast(path: Path) -> list[str]:
    from worker.dev.tiny_model import tiny_model_engine_args  # noqa: PLC0415

    return [*tiny_model_engine_args(path), "--no-enable-return-routed-experts"]


async def main(args: argparse.Namespace) -> None:
    with (
        env_or_local_broker() as bootstrap,
        tempfile.TemporaryDirectory(prefix="vkw-bench-wu-") as tmp,
    ):
        print(f"broker {bootstrap}")
        root = Path(tmp)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if args.reload_only:
            await reload_speed(root, args.reload_gb)
            return
        (root / "mock").mkdir()
        await control_path(bootstrap, args.mock_workers, root / "mock")
        if not args.skip_vllm:
            await real_vllm(bootstrap, args.jobs, args.tokens, root)
            await reload_speed(root, args.reload_gb)


if __name__ == "__main__":  # vLLM spawns its engine processes, which re-import this file
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=8, help="generations in flight (vLLM)")
    parser.add_argument("--tokens", type=int, default=450, help="tokens each")
    parser.add_argument("--mock-workers", type=int, default=4)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--reload-gb", type=float, default=1.0, help="reload checkpoint size")
    parser.add_argument("--reload-only", action="store_true", help="only the reload speed")
    asyncio.run(main(parser.parse_args()))
