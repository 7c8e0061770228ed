"""What stands between a weight update and the jobs after it: the checkpoint's bytes checked
before anything pauses, the check of the loaded weights, the rollback when either fails, and
the hold (`needs_weights`) when the old weights cannot be put back.

The vLLM side (`WeightLoads`) runs here against a fake engine host whose RPCs answer as vLLM's
worker would; the real engine is the vLLM lane's
(`tests/integration/vllm/test_weight_updates.py`).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client import generate_latest

from schemas import Job, SamplingSpec, UpdateWeights, WorkerStatus, encode
from tests.unit.test_checkpoint_bytes import SERVED, TENSORS, checkpoint, write_shard
from tests.unit.test_control_fuzz import caught_up_plane
from worker.core.clock import SYSTEM_CLOCK
from worker.core.errors import WeightsLostError, WeightUpdateError
from worker.dev.harness.waiting import wait_for
from worker.engines.mock import MockEngine, MockEngineSettings
from worker.engines.steerable import SteerableEngine
from worker.engines.vllm_engine import MoeLayout, probe_problem, routing_problem
from worker.engines.vllm_loads import WeightLoads
from worker.engines.vllm_reload import Probe, same_model_after_reload

# ---- what the probe after an update must look like -------------------------------------------

LAYOUT = MoeLayout(num_layers=3, top_k=2, num_experts=8, moe_layers=(0, 2))


def routing(rows: int = 5) -> np.ndarray:
    out = np.zeros((rows, 3, 2), np.uint8)
    out[:, 0] = [1, 4]
    out[:, 2] = [7, 2]
    return out


def probe(routed: np.ndarray | None = None, logprobs: Any = (-1.0, -2.0)) -> Probe:
    return Probe(
        prompt_len=4,
        token_ids=(5, 6),
        routed_experts=routing() if routed is None else routed,
        logprobs=logprobs,
    )


def test_a_probe_with_finite_logprobs_and_real_routing_passes():
    assert probe_problem(probe(), LAYOUT) is None
    assert probe_problem(probe(logprobs=(-1.0, -2.0)), None) is None


@pytest.mark.parametrize(
    ("logprobs", "problem"),
    [
        ((float("nan"),) * 2, "logprobs are not finite: [nan, nan]"),
        ((-1.0, float("-inf")), "logprobs are not finite"),
        ((-1.0, None), "logprobs are not finite"),
        (None, "no logprob for every token"),
        ((-1.0,), "no logprob for every token"),
    ],
)
def test_logprobs_that_are_not_finite_fail_the_probe(logprobs, problem):
    found = probe_problem(probe(logprobs=logprobs), LAYOUT)
    assert found is not None and problem in found


def test_an_moe_layer_routing_every_row_to_expert_0_fails_even_with_top_1():
    top1 = MoeLayout(num_layers=3, top_k=1, num_experts=8, moe_layers=(0, 2))
    routed = np.zeros((5, 3, 1), np.uint8)
    routed[:, 0] = 3
    assert routing_problem(routed, rows=5, layout=top1) == (
        "MoE layer 2 routes every row to expert 0 and nothing else"
    )


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda r: r[:4], "shape (4, 3, 2), expected (5, 3, 2)"),
        (lambda r: np.where(r == 7, 9, r), "outside [0, 8)"),
        (np.zeros_like, "every routed expert id is 0"),
        (lambda r: np.concatenate([r[:, :2], np.full((5, 1, 2), 3, np.uint8)], 1), "row 0 routes"),
    ],
)
def test_routing_that_is_not_real_fails_the_probe(change, problem):
    found = probe_problem(probe(change(routing())), LAYOUT)
    assert found is not None and "routing is not real" in found and problem in found


def test_missing_routing_fails_the_probe_when_capture_is_on():
    checked = Probe(prompt_len=4, token_ids=(5, 6), routed_experts=None, logprobs=(-1.0, -2.0))
    assert "returned no routed experts" in (probe_problem(checked, LAYOUT) or "")


# ---- rollback: WeightLoads on a fake vLLM ----------------------------------------------------


class FakeLlm:
    """The RPCs `WeightLoads` makes, answered as vLLM's worker with our extension would:
    `broken` checkpoints load and leave NaN, `unloadable` ones raise part-way."""

    def __init__(self, host: FakeHost) -> None:
        self.host = host
        self.loaded: list[str] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "vkw_reload_checkpoint":
            (path,) = args
            self.loaded.append(Path(path).name)
            if Path(path).name in self.host.unloadable:
                raise RuntimeError(f"Worker failed with error 'no parameter in {path}'")
            self.host.serving = Path(path).name
            return [{"path": "direct", "moe_layers": 2, "why": ""}]
        assert method == "vkw_nonfinite_parameters"
        return [["model.norm.weight"] if self.host.serving in self.host.nan else []]

    async def reset_prefix_cache(self) -> bool:
        return not self.host.frozen


class FakeHost:
    """The engine side `WeightLoads` drives (`worker.engines.vllm_loads.EngineHost`)."""

    def __init__(self, served: Path) -> None:
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=str(served), hf_config=SERVED)
        )
        self.weight_version = 0
        self.frozen = False
        self.serving = served.name
        #: Checkpoints by name: NaN after loading, failing the probe, raising part-way.
        self.nan: set[str] = set()
        self.bad_probe: set[str] = set()
        self.unloadable: set[str] = set()
        self.probes: list[str] = []
        self.events: list[str] = []
        self.llm = FakeLlm(self)

    def running_llm(self) -> FakeLlm:
        return self.llm

    async def stamp_version(self, version: int, *, in_vllm: bool = True) -> None:
        self.weight_version = version

    async def freeze(self) -> None:
        self.frozen = True
        self.events.append("freeze")

    async def thaw(self) -> None:
        self.frozen = False
        self.events.append("thaw")

    async def weights_problem(self) -> str | None:
        assert not self.frozen, "vLLM schedules nothing while frozen: the probe would hang"
        self.probes.append(self.serving)
        return "logprobs are not finite" if self.serving in self.bad_probe else None

    async def requeue_unstarted(self) -> int:
        self.events.append("requeue")
        return 0

    async def rebuild(self, vllm_config: Any, engine_args: list[str], version: int) -> None:
        raise AssertionError("an in-place update never rebuilds the engine")

    def configure(self, checkpoint: Path) -> tuple[Any, list[str]]:
        raise AssertionError("an in-place update never configures another engine")


@pytest.fixture
def weights(tmp_path: Path) -> tuple[WeightLoads, FakeHost, Path]:
    for name in ("a", "b", "nan", "huge", "unknown"):
        checkpoint(tmp_path / name)
    host = FakeHost(tmp_path / "a")
    return WeightLoads(host, "in-place", None, clock=SYSTEM_CLOCK), host, tmp_path


async def test_an_update_that_passes_is_served(weights):
    loads, host, root = weights
    await loads.load(str(root / "b"), 1)
    assert (host.serving, host.weight_version, host.probes) == ("b", 1, ["b"])


async def test_nan_weights_are_rolled_back_in_place_without_a_probe(weights):
    loads, host, root = weights
    host.nan.add("nan")
    with pytest.raises(WeightUpdateError, match=r"NaN or infinity: model\.norm\.weight") as raised:
        await loads.load(str(root / "nan"), 1)
    assert not isinstance(raised.value, WeightsLostError)
    assert "rolled back in place to" in str(raised.value)
    assert (host.serving, host.weight_version) == ("a", 0)
    assert host.llm.loaded == ["nan", "a"]


async def test_a_probe_that_fails_rolls_back_and_the_old_weights_are_probed(weights):
    loads, host, root = weights
    host.bad_probe.add("huge")
    with pytest.raises(WeightUpdateError, match="failed the check: logprobs are not finite"):
        await loads.load(str(root / "huge"), 1)
    assert (host.serving, host.weight_version, host.probes) == ("a", 0, ["huge", "a"])


async def test_a_load_failing_part_way_is_rolled_back_in_place(weights):
    loads, host, root = weights
    host.unloadable.add("unknown")
    with pytest.raises(WeightUpdateError, match=r"no parameter in .* rolled back in place"):
        await loads.load(str(root / "unknown"), 1)
    assert (host.serving, host.weight_version) == ("a", 0)


async def test_when_the_previous_weights_cannot_load_again_they_are_lost(weights):
    loads, host, root = weights
    await loads.load(str(root / "b"), 1)
    host.nan.add("nan")
    host.unloadable.add("b")  # its files are gone since
    with pytest.raises(WeightsLostError, match="loading the previous checkpoint again failed"):
        await loads.load(str(root / "nan"), 2)
    assert host.weight_version == 1


async def test_after_a_transfer_there_is_nothing_to_roll_back_to(weights, monkeypatch):
    loads, host, root = weights
    # vLLM's transfer sequence itself is vLLM's (and imports it): passed here.
    monkeypatch.setattr("worker.engines.vllm_loads.transfer_weights", _noop)
    await loads.transfer("nccl", {}, {}, 1)
    assert host.probes == ["a"]  # what the fake serves: the transfer's weights, probed
    host.nan.add("nan")
    with pytest.raises(WeightsLostError, match="came from a transfer"):
        await loads.load(str(root / "nan"), 2)
    assert host.weight_version == 1


async def test_an_in_place_update_missing_a_weight_is_refused_before_the_engine_is_touched(
    weights,
):
    loads, host, root = weights
    partial = root / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    write_shard(partial / "model.safetensors", {"a.weight": TENSORS["a.weight"]})
    with pytest.raises(WeightUpdateError, match=r"does not hold every weight.*b\.weight missing"):
        await loads.load(str(partial), 1)
    assert (host.llm.loaded, host.serving, host.weight_version) == ([], "a", 0)


async def test_an_in_place_update_changing_the_config_is_refused_before_the_engine_is_touched(
    weights,
):
    loads, host, root = weights
    (root / "b" / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "rope_theta": 1e6}))
    with pytest.raises(WeightUpdateError, match=r"changes the model's config \(rope_theta"):
        await loads.load(str(root / "b"), 1)
    assert (host.llm.loaded, host.serving, host.weight_version) == ([], "a", 0)


def rewrite(checkpoint: Path) -> None:
    """Other weights in the same files: what a trainer writing one fixed directory leaves."""
    shard = checkpoint / "model.safetensors"
    write_shard(shard, {name: array + 1 for name, array in TENSORS.items()})
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


@pytest.mark.parametrize("served", ["the checkpoint the engine was built on", "an update"])
async def test_a_rollback_to_a_checkpoint_rewritten_since_it_was_loaded_loses_the_weights(
    weights, served
):
    loads, host, root = weights
    before, version = root / "a", 0
    if served == "an update":
        await loads.load(str(root / "b"), 1)
        before, version = root / "b", 1
    rewrite(before)
    host.nan.add("nan")
    with pytest.raises(WeightsLostError, match=f"{before} changed on disk since it was loaded"):
        await loads.load(str(root / "nan"), 2)
    # Not loaded again: its files now hold other weights than version `version` had.
    assert host.llm.loaded[-1] == "nan" and host.weight_version == version


class RebuildingHost(FakeHost):
    """A host whose every update builds a new engine on the checkpoint (`rebuild` mode)."""

    def configure(self, checkpoint: Path) -> tuple[Any, list[str]]:
        config = SimpleNamespace(
            model_config=SimpleNamespace(model=str(checkpoint), hf_config=SERVED)
        )
        return config, ["--model", str(checkpoint)]

    async def rebuild(self, vllm_config: Any, engine_args: list[str], version: int) -> None:
        self.vllm_config = vllm_config
        self.serving = Path(vllm_config.model_config.model).name
        self.weight_version = version
        self.events.append(f"build {self.serving}")


async def test_a_rebuild_back_on_a_checkpoint_rewritten_since_it_was_loaded_loses_the_weights(
    tmp_path,
):
    for name in ("a", "b", "huge"):
        checkpoint(tmp_path / name)
    host = RebuildingHost(tmp_path / "a")
    host.bad_probe.add("huge")
    loads = WeightLoads(host, "rebuild", None, clock=SYSTEM_CLOCK)
    await loads.load(str(tmp_path / "b"), 1)
    rewrite(tmp_path / "b")
    with pytest.raises(WeightsLostError, match=r"built on .*/b again, but its files changed"):
        await loads.load(str(tmp_path / "huge"), 2)
    # An engine runs (on the rewritten files), reporting version 1; the worker holds its jobs.
    assert host.events == ["build b", "build huge", "build b"] and host.weight_version == 1


async def test_a_rebuild_back_on_an_untouched_checkpoint_serves_it_again(tmp_path):
    for name in ("a", "b", "huge"):
        checkpoint(tmp_path / name)
    host = RebuildingHost(tmp_path / "a")
    host.bad_probe.add("huge")
    loads = WeightLoads(host, "rebuild", None, clock=SYSTEM_CLOCK)
    await loads.load(str(tmp_path / "b"), 1)
    with pytest.raises(WeightUpdateError, match="built on the previous weights again") as raised:
        await loads.load(str(tmp_path / "huge"), 2)
    assert not isinstance(raised.value, WeightsLostError)
    assert (host.serving, host.weight_version) == ("b", 1)


async def _noop(*args: Any, **kwargs: Any) -> None:
    return


async def test_a_load_while_frozen_owes_the_probe_until_the_thaw(weights):
    loads, host, root = weights
    host.bad_probe.add("huge")
    host.frozen = True
    await loads.load(str(root / "huge"), 1)  # the parameters are finite: nothing to see yet
    assert host.probes == [] and host.weight_version == 1 and host.events == ["requeue"]
    host.frozen = False
    with pytest.raises(WeightUpdateError, match=r"logprobs are not finite.*rolled back"):
        await loads.after_thaw()
    # Frozen again for the rollback (the old weights are not probed while frozen), thawed.
    assert host.events == ["requeue", "freeze", "thaw"]
    assert (host.serving, host.weight_version, host.probes) == ("a", 0, ["huge"])
    await loads.after_thaw()  # owed once
    assert host.probes == ["huge"]
    # What a later failure goes back to is A, not the checkpoint that failed after the thaw.
    host.unloadable.add("unknown")
    with pytest.raises(WeightUpdateError, match=r"rolled back in place to .*/a "):
        await loads.load(str(root / "unknown"), 2)
    assert host.serving == "a"


class SteppingClock:
    """A clock that moves `step_s` at each reading."""

    def __init__(self, step_s: float) -> None:
        self.now = 0.0
        self.step_s = step_s

    def monotonic(self) -> float:
        self.now += self.step_s
        return self.now

    def wall(self) -> float:
        return 1_800_000_000.0 + self.monotonic()


class ReloadingLlm:
    """An engine whose in-place reload of the served checkpoint succeeds."""

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        assert method == "vkw_reload_checkpoint"
        return [{"path": "direct", "moe_layers": 2, "why": ""}]

    async def reset_prefix_cache(self) -> bool:
        return True


async def test_the_start_up_reload_check_is_timed_on_the_engines_clock(monkeypatch, tmp_path):
    before = probe()

    async def same_probe(llm: Any, vllm_config: Any, request_id: str) -> Probe:
        return before

    monkeypatch.setattr("worker.engines.vllm_reload.probe", same_probe)
    verdict = await same_model_after_reload(
        ReloadingLlm(), None, tmp_path, before, clock=SteppingClock(2.5)
    )
    assert verdict.mode == "in-place"
    assert "(2.50 s with the probe)" in verdict.reason


async def test_the_cache_salt_changes_with_every_load_even_of_the_same_version(weights):
    loads, host, root = weights
    salts = {loads.cache.salt}
    host.nan.add("nan")
    with pytest.raises(WeightUpdateError):
        await loads.load(str(root / "nan"), 1)
    salts.add(loads.cache.salt)
    await loads.load(str(root / "b"), 1)
    salts.add(loads.cache.salt)
    assert len(salts) == 3


# ---- the steered engine and the control plane --------------------------------------------


def mock_checkpoint(root: Path, name: str, **config: Any) -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def steered(*, in_place: bool = False, latency_ms: float = 0) -> SteerableEngine:
    settings = MockEngineSettings(
        num_layers=2,
        top_k=1,
        num_experts=4,
        in_place_updates=in_place,
        per_token_latency_ms=latency_ms,
    )
    return SteerableEngine(MockEngine(settings), clock=SYSTEM_CLOCK)


def job(job_id: str, tokens: int = 4) -> Job:
    return Job(job_id=job_id, prompt_token_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=tokens))


async def test_a_rolled_back_update_leaves_the_gate_open_and_the_version(tmp_path):
    engine = steered()
    with pytest.raises(WeightUpdateError, match="rolled back"):
        await engine.load_checkpoint(
            str(mock_checkpoint(tmp_path, "x", mock_check="fails")), 1, "wait"
        )
    assert not engine.needs_weights and engine.weight_version == 0
    out = await asyncio.wait_for(engine.generate(job("after"), "after"), 5)
    assert out.weight_version == 0


async def test_lost_weights_hold_every_job_through_a_resume_until_an_update_loads(tmp_path):
    engine = steered()
    lost = mock_checkpoint(tmp_path, "lost", mock_check="fails_for_good")
    with pytest.raises(WeightsLostError):
        await engine.load_checkpoint(str(lost), 1, "wait")
    assert engine.needs_weights
    held = asyncio.create_task(engine.generate(job("held"), "held"))
    await engine.resume()
    await asyncio.sleep(0.05)
    assert not held.done()
    await engine.load_checkpoint(str(mock_checkpoint(tmp_path, "good")), 2, "wait")
    assert not engine.needs_weights
    assert (await asyncio.wait_for(held, 5)).weight_version == 2


async def test_requests_frozen_across_an_update_that_loses_the_weights_stay_frozen(tmp_path):
    engine = steered(in_place=True, latency_ms=20)
    kept = asyncio.create_task(engine.generate(job("kept", 40), "kept"))
    await wait_for(lambda: engine._inner.generated_tokens.get("kept", 0) > 0, 5, "a token")  # type: ignore[attr-defined]
    lost = mock_checkpoint(tmp_path, "lost", mock_check="fails_for_good")
    with pytest.raises(WeightsLostError):
        await engine.load_checkpoint(str(lost), 1, "keep")
    await asyncio.sleep(0.1)  # a step under way when it froze ends
    frozen_at = engine._inner.generated_tokens["kept"]  # type: ignore[attr-defined]
    await engine.resume()
    await asyncio.sleep(0.2)
    assert engine._inner.generated_tokens["kept"] == frozen_at  # type: ignore[attr-defined]
    await engine.load_checkpoint(str(mock_checkpoint(tmp_path, "good")), 2, "keep")
    out = await asyncio.wait_for(kept, 10)
    assert len(out.completions[0].token_ids) == 40
    assert [s.version for s in out.completions[0].weight_versions] == [0, 2]  # type: ignore[union-attr]


async def test_a_checkpoint_that_cannot_load_is_refused_before_the_jobs_are_waited_for(tmp_path):
    engine = steered(latency_ms=50)
    running = asyncio.create_task(engine.generate(job("long", 100), "long"))
    await wait_for(lambda: engine.inside == 1, 5, "a job inside")
    bad = mock_checkpoint(tmp_path, "other", num_hidden_layers=99)
    with pytest.raises(WeightUpdateError, match="another architecture"):
        await asyncio.wait_for(engine.load_checkpoint(str(bad), 1, "wait"), 1)
    assert not running.done()
    running.cancel()


async def test_heartbeats_and_metrics_say_needs_weights_while_the_weights_are_lost(tmp_path):
    lost = mock_checkpoint(tmp_path, "lost", mock_check="fails_for_good")
    good = mock_checkpoint(tmp_path, "good")
    records = [
        encode(UpdateWeights(command_id="lose", version=1, path=str(lost))),
    ]
    values = {"weights_root": [str(tmp_path)], "status_interval_s": 0.02}
    plane, status, _ = await caught_up_plane(values, records)
    running = asyncio.create_task(plane.run())
    try:
        await wait_for(lambda: "lose" in status.acks(), 5, "the acknowledgement")
        ack = status.acks()["lose"]
        assert ack.outcome == "failed" and "fails_for_good" in ack.detail
        await wait_for(
            lambda: any(isinstance(m, WorkerStatus) and m.needs_weights for m in status.sent),
            5,
            "a heartbeat saying needs_weights",
        )
        assert b"vkw_needs_weights 1.0" in generate_latest(plane._metrics.registry)
        plane._consumer.add(encode(UpdateWeights(command_id="load", version=2, path=str(good))))
        await wait_for(lambda: "load" in status.acks(), 5, "the second acknowledgement")
        assert status.acks()["load"].outcome == "ok"
        assert not plane.status().needs_weights
        assert b"vkw_needs_weights 0.0" in generate_latest(plane._metrics.registry)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
