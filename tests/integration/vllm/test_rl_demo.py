"""`make rl-demo`: three RL steps on real vLLM, each on the weights the step before wrote."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import msgspec
import pytest

from worker.client.rl_loop import StepReport
from worker.dev.tiny_model import TINY_MODEL_SPEC

pytestmark = [pytest.mark.vllm, pytest.mark.broker]


# A subprocess that builds one vLLM engine (its worker's log holds one engine start; the
# updates go in place): 67-181 s in the vLLM lane on a busy 2-core machine, 378 s once with two
# other test runs beside it. The demo's own bound (840 s) fires first and says where it got to.
@pytest.mark.timeout(900)
async def test_every_result_of_step_k_carries_version_k_and_replay_arrays_fit_their_layout(
    kafka_bootstrap_servers, tmp_path: Path, tiny_model: Path
):
    report = tmp_path / "report.json"
    # The demo reuses a tiny model it finds in its .demo directory (one seed, the same bytes):
    # the run's, rather than one more built in the subprocess.
    shutil.copytree(tiny_model, tmp_path / ".demo" / "tiny-model")
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap_servers}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker.dev.rl_demo",
        "--report",
        str(report),
        cwd=tmp_path,  # its .demo directory (model, checkpoints, log) goes here
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 840)
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        raise AssertionError(
            f"the RL demo did not finish in 840 s; its output ends:\n{out.decode()[-4000:]}"
        ) from None
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    steps = msgspec.json.decode(report.read_bytes(), type=list[StepReport])
    assert [s.step for s in steps] == [0, 1, 2]
    for step in steps:
        assert len(step.samples) == 8  # two groups of n=4
        assert {s.weight_version for s in step.samples} == {step.step}
        for sample in step.samples:
            # prime-rl's rule: one row per position of prompt + completion, every layer.
            assert sample.replay_shape == (
                sample.prompt_len + sample.tokens,
                TINY_MODEL_SPEC.num_layers,
                TINY_MODEL_SPEC.top_k,
            )
        assert step.samples_per_s > 0 and step.tokens_per_s > 0
        assert f"step {step.step}: 8 samples" in text
        # Each step after the first says what its update cost.
        if step.step == 0:
            assert step.update_seconds is None
        else:
            assert step.update_seconds is not None and step.update_seconds > 0
            assert f"the fleet serves version {step.step} after" in text
    # Each step after the first ran on a checkpoint the loop wrote.
    written = sorted(p.name for p in (tmp_path / ".demo" / "rl-checkpoints").iterdir())
    assert written == ["step-1", "step-2"]
