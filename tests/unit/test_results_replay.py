"""`results --replay`: the .npz it writes, and the flags it refuses, without a broker."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from schemas import (
    RECIPES,
    Completed,
    Completion,
    ReplaySample,
    RoutedExperts,
    replay_arrays,
)
from worker.cli.main import main
from worker.cli.replay_out import ReplayWriter
from worker.core.errors import ConfigError


def routed_completion(index: int, prompt_len: int, tokens: int, start: int = 0) -> Completion:
    rows = prompt_len + tokens - 1 - start
    ids = (np.arange(rows * 3 * 2).reshape(rows, 3, 2) + index) % 300
    return Completion(
        index=index,
        token_ids=list(range(tokens)),
        text="",
        finish_reason="length",
        routed_experts=RoutedExperts.from_array(ids, start=start, num_experts=300),
    )


def test_the_file_holds_one_entry_per_job_and_completion_in_one_dtype(tmp_path: Path, capsys):
    out = tmp_path / "run.npz"
    writer = ReplayWriter("prime-rl", out, None)
    group = Completed(
        job_id="g",
        prompt_token_count=4,
        completions=[routed_completion(0, 4, 3), routed_completion(1, 4, 6)],
    )
    late = Completed(
        job_id="late", prompt_token_count=5, completions=[routed_completion(0, 5, 2, start=2)]
    )
    writer.add(group)
    writer.add(late)
    writer.add(group)  # a duplicate answer adds nothing

    assert writer.finish() == 1

    with np.load(out) as arrays:
        assert sorted(arrays.files) == ["g/0", "g/1"]
        expected = replay_arrays(
            [ReplaySample(c, 4) for c in group.completions], RECIPES["prime-rl"]
        )
        for name, want in zip(["g/0", "g/1"], expected, strict=True):
            np.testing.assert_array_equal(arrays[name], want)
            assert arrays[name].dtype == np.uint16  # the model's 300 experts, for both
    err = capsys.readouterr().err
    assert "late/0: not replayable as prime-rl: routing starts at position 2" in err
    assert f"2 replay arrays (prime-rl, uint16) written to {out}, 1 not replayable" in err


def test_a_missing_payload_is_named_and_the_rest_written(tmp_path: Path, capsys):
    inline = routed_completion(0, 3, 2)
    assert inline.routed_experts is not None
    gone = inline.routed_experts.as_reference(
        (tmp_path / "gone.bin").as_uri(), hashlib.sha256(inline.routed_experts.data).hexdigest()
    )
    writer = ReplayWriter("slime", tmp_path / "run.npz", None)
    writer.add(Completed(job_id="ok", prompt_token_count=3, completions=[inline]))
    writer.add(
        Completed(
            job_id="ref",
            prompt_token_count=3,
            completions=[
                Completion(
                    index=0, token_ids=[0, 1], text="", finish_reason="length", routed_experts=gone
                )
            ],
        )
    )
    assert writer.finish() == 1
    with np.load(tmp_path / "run.npz") as arrays:
        assert arrays.files == ["ok/0"] and arrays["ok/0"].shape == (4, 3, 2)
    assert "ref/0: not replayable as slime:" in capsys.readouterr().err


def test_bad_replay_flags_are_refused_before_connecting(tmp_path: Path, capsys):
    base = ["results", "--bootstrap-servers", "127.0.0.1:1"]
    out = ["--out", str(tmp_path / "x.npz")]
    with pytest.raises(SystemExit) as info:
        main([*base, "--replay", "openrlhf", *out])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--replay: invalid choice: 'openrlhf'" in err
    assert all(name in err for name in RECIPES)
    cases = [
        ([*base, "--replay", "verl"], "--replay writes its arrays to --out FILE.npz"),
        ([*base, "--replay", "verl", *out, "--raw"], "--replay takes whole results"),
        ([*base, "--replay", "verl", *out, "--follow"], "leave out --follow"),
        ([*base, "--replay", "verl", *out, "--num-experts", "0"], "--num-experts must be >= 1"),
        ([*base, "--num-experts", "8"], "--num-experts is for --replay"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no recipe 'x'; choose one of nemo-rl, prime-rl"):
        ReplayWriter("x", tmp_path / "x.npz", None)
