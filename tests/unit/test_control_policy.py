"""What a control command may make a worker do, without a broker: the weights policy, the
catch-up plan, command signatures and the settings that switch them on."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas import (
    Abort,
    Pause,
    Resume,
    SchemaError,
    UpdateWeights,
    decode_command,
    decode_status,
    encode,
    sign_command,
    signature_problem,
)
from worker.control.catch_up import CatchUpPlan, ControlLog, FleetState, plan_catch_up
from worker.control.commands import staleness
from worker.control.policy import WeightsPolicy
from worker.core.config import SECRET_FIELDS, settings_from
from worker.core.errors import ConfigError, WeightUpdateError

KEY = b"k" * 32


def policy(**values: Any) -> WeightsPolicy:
    return WeightsPolicy(settings_from(values, {}))


def checkpoint(root: Path, name: str = "ckpt", **config: Any) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"name": name, **config}))
    (path / "model.safetensors").write_bytes(b"\0" * 8)
    return path


def update(path: str | Path, version: int = 1, **kwargs: Any) -> UpdateWeights:
    return UpdateWeights(command_id=f"u{version}", version=version, path=str(path), **kwargs)


def refusal(p: WeightsPolicy, command: UpdateWeights) -> str:
    with pytest.raises(WeightUpdateError) as info:
        p.check(command)
    return str(info.value)


# ---- weights policy ------------------------------------------------------------------------


def test_a_checkpoint_under_the_root_is_taken_and_one_outside_is_refused(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    inside, outside = checkpoint(root), checkpoint(elsewhere)
    p = policy(weights_root=[str(root)])
    p.check(update(inside))
    assert "outside --weights-root" in refusal(p, update(outside))
    # `..` and symlinks are resolved before the comparison.
    assert "outside --weights-root" in refusal(p, update(f"{root}/../elsewhere/ckpt"))
    (root / "link").symlink_to(outside)
    assert "outside --weights-root" in refusal(p, update(root / "link"))


def test_a_file_inside_the_checkpoint_that_links_outside_the_root_is_refused(tmp_path):
    root = tmp_path / "root"
    ckpt = checkpoint(root)
    secret = tmp_path / "elsewhere" / "weights.safetensors"
    secret.parent.mkdir()
    secret.write_bytes(b"x")
    (ckpt / "model-2.safetensors").symlink_to(secret)
    assert "links outside --weights-root" in refusal(policy(weights_root=[str(root)]), update(ckpt))


def test_without_a_root_path_updates_are_refused_unless_any_path_is_allowed(tmp_path):
    ckpt = checkpoint(tmp_path)
    assert "without --weights-root" in refusal(policy(), update(ckpt))
    policy(allow_any_weights_path=True).check(update(ckpt))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda c: (c / "modeling_evil.py").write_text("import os"), "brings code"),
        (lambda c: (c / "sub").mkdir() or (c / "sub" / "x.py").write_text(""), "brings code"),
        (
            lambda c: (c / "config.json").write_text(
                json.dumps({"auto_map": {"AutoModel": "m.M"}})
            ),
            "config.json names its own code",
        ),
        (
            lambda c: (c / "tokenizer_config.json").write_text(json.dumps({"auto_map": {}})),
            "tokenizer_config.json names its own code",
        ),
    ],
)
def test_a_checkpoint_that_brings_its_own_code_is_refused_unless_allowed(tmp_path, make, message):
    ckpt = checkpoint(tmp_path / "root")
    make(ckpt)
    root = [str(tmp_path / "root")]
    assert message in refusal(policy(weights_root=root), update(ckpt))
    policy(weights_root=root, allow_remote_code_updates=True).check(update(ckpt))


def test_a_fifo_or_device_in_the_checkpoint_is_refused_without_reading_it(tmp_path):
    ckpt = checkpoint(tmp_path / "root")
    (ckpt / "config.json").unlink()
    os.mkfifo(ckpt / "config.json")  # a read would block for ever
    p = policy(weights_root=[str(tmp_path / "root")])
    t0 = time.monotonic()
    assert "config.json is not a regular file" in refusal(p, update(ckpt))
    assert time.monotonic() - t0 < 5
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to("/dev/zero")
    anywhere = policy(allow_any_weights_path=True)
    assert "config.json is not a regular file" in refusal(anywhere, update(ckpt))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/no/such/dir", "no checkpoint at /no/such/dir: /no/such/dir/config.json is missing"),
        ("/tmp/a\x00b", "NUL character"),
        ("/dev/null", "not a directory"),
    ],
)
def test_paths_that_are_no_checkpoint_are_refused_with_a_reason(path, message):
    assert message in refusal(policy(allow_any_weights_path=True), update(path))


def test_weight_transfers_are_refused_unless_allowed():
    nccl = UpdateWeights(command_id="t", version=1, backend="nccl", update_info={"names": []})
    assert "--allow-weight-transfer" in refusal(policy(allow_any_weights_path=True), nccl)
    policy(allow_weight_transfer=True).check(nccl)


# ---- catch-up plan ---------------------------------------------------------------------------


def plan(
    start: int, *commands: Any, applied: set[str] | None = None, answered_below: int | None = None
) -> CatchUpPlan:
    """The plan for `commands` (offsets 0, 1, ...), all addressed to the worker; by default the
    fleet answered all of them and applied those in `applied` (all when None)."""
    log = ControlLog(end=len(commands))
    for offset, command in enumerate(commands):
        log.addressed.append((offset, command))
        log.ids[command.command_id] = offset
    state = FleetState(
        applied={c.command_id for c in commands} if applied is None else applied,
        answered_by={"other": len(commands) if answered_below is None else answered_below},
    )
    return plan_catch_up(log, state, start)


def transfer(version: int) -> UpdateWeights:
    return UpdateWeights(
        command_id=f"t{version}", version=version, backend="nccl", update_info={"n": 1}
    )


def test_the_plan_takes_what_the_fleet_applied_not_what_it_was_told():
    # The case: v9 named a path the fleet refused (acknowledged failed everywhere),
    # v7 came after it and was applied. Replaying commands made v9 "applied", refused v7 as
    # older, and every restarted worker fell back to v5 while the fleet served 7.
    got = plan(0, update("/a", 5), update("/typo", 9), update("/c", 7), applied={"u5", "u7"})
    assert [c.version for c in got.checkpoints] == [7, 5]
    # A forced rollback the fleet applied is the state; what it rolled back from a fall-back.
    got = plan(0, update("/a", 5), update("/c", 7), update("/d", 2, force=True))
    assert [c.version for c in got.checkpoints] == [2, 7, 5]
    # A cut-short checkpoint every worker acknowledged failed is nobody's state.
    got = plan(0, update("/a", 5), update("/cut", 6), applied={"u5"})
    assert [c.version for c in got.checkpoints] == [5]
    assert got.unanswered == [] and got.seen == {"u5", "u6"}


def test_commands_nobody_answered_are_applied_as_live_ones():
    got = plan(0, update("/a", 5), update("/b", 6), Pause(command_id="p"), answered_below=1)
    assert [c.version for c in got.checkpoints] == [5]
    assert [(o, c.command_id) for o, c in got.unanswered] == [(1, "u6"), (2, "p")]
    assert got.seen == {"u5"} and got.pause is None
    # A fleet that never answered anything: every command is for the worker to judge.
    assert len(plan(0, update("/a", 5), answered_below=0).unanswered) == 1


def test_the_plan_takes_nothing_older_than_the_start_version():
    got = plan(10, update("/old", 5), update("/older", 9, force=True))
    assert got.checkpoints == []
    assert [c.version for c in plan(10, update("/old", 5), update("/new", 10)).checkpoints] == [10]


def test_a_latest_transfer_is_not_replayed_but_reported():
    got = plan(0, update("/a", 3), transfer(5))
    assert [c.version for c in got.checkpoints] == [3]
    assert got.transfer is not None and got.transfer.version == 5
    # A checkpoint after the transfer is the state again.
    got = plan(0, update("/a", 3), transfer(5), update("/b", 6))
    assert got.transfer is None and got.checkpoints[0].version == 6
    # A checkpoint after the transfer that the fleet refused: the transfer stands.
    assert plan(0, transfer(5), update("/b", 4), applied={"t5"}).transfer is not None


def test_the_plan_keeps_the_latest_pause_or_resume_the_fleet_applied():
    assert isinstance(plan(0, Pause(command_id="p"), Resume(command_id="r")).pause, Resume)
    assert isinstance(plan(0, Resume(command_id="r"), Pause(command_id="p")).pause, Pause)
    # A pause nobody applied (produced again after a trim, skipped as a duplicate) is none.
    replayed = plan(0, Resume(command_id="r"), Pause(command_id="p"), applied={"r"})
    assert isinstance(replayed.pause, Resume)


# ---- freshness -------------------------------------------------------------------------------


def test_a_command_is_fresh_only_within_the_window_around_now():
    settings = settings_from({"command_max_age_s": 600, "max_clock_skew_s": 60}, {})
    now = 1_000_000.0

    def at(issued: float | None, **kwargs: Any) -> str | None:
        return staleness(update("/a", 3, issued_at=issued, **kwargs), now, settings)

    assert at(now) is None
    assert at(now - 650) is None  # older than the window, within the skew allowed
    assert at(now + 50) is None
    assert "stale: issued 700 s ago" in (at(now - 700) or "")
    assert "in the future" in (at(now + 120) or "")
    # Without a key a command need not say when it was issued; a rollback must.
    assert at(None) is None
    assert "rollback (force) must say" in (at(None, force=True) or "")
    keyed = settings_from({"control_hmac_key": "k" * 20}, {})
    assert "signed command must say" in (staleness(update("/a"), now, keyed) or "")


# ---- signatures ------------------------------------------------------------------------------


def test_a_signed_command_verifies_and_any_change_breaks_it():
    signed = encode(sign_command(update("/ckpt/step-3", 3, init_info={"é": [1.5, None]}), KEY))
    assert signature_problem(signed, KEY) is None
    assert decode_command(signed).signature is not None
    assert signature_problem(signed, b"another key, just as long!!") == "bad signature"
    assert signature_problem(signed.replace(b"step-3", b"step-4"), KEY) == "bad signature"
    # Fields the sender did not sign, added on the way, break it too.
    tampered = signed.replace(b'"force":false', b'"force":true')
    assert signature_problem(tampered, KEY) == "bad signature"
    assert signature_problem(encode(update("/x")), KEY) == "unsigned"


@pytest.mark.parametrize(
    "value",
    [
        b'{"kind":"resume","command_id":"r","signature":7}',
        b'{"kind":"resume","command_id":"r","signature":"\xc3\xa9\xc3\xa9"}',
        b'{"kind":"resume","command_id":"r","signature":"\\ud800"}',
        b"[1, 2]",
        b"\xff\xfe",
        b"",
    ],
)
def test_a_malformed_signature_is_a_problem_never_an_exception(value):
    assert signature_problem(value, KEY) is not None


def test_the_canonical_encoding_ignores_key_order_and_whitespace():
    signed = sign_command(Abort(command_id="a", job_ids=["j"]), KEY)
    fields = msgspec.json.decode(encode(signed))
    reordered = json.dumps(dict(reversed(list(fields.items()))), indent=2).encode()
    assert signature_problem(reordered, KEY) is None


# ---- the status schema -----------------------------------------------------------------------


def test_a_heartbeat_claiming_a_huge_interval_is_no_status():
    beat = {
        "type": "status",
        "worker": "w",
        "group": "g",
        "model": "m",
        "weight_version": 0,
        "paused": False,
        "in_flight": 0,
        "lag": None,
        "engine_healthy": True,
        "uptime_s": 1.0,
        "at": time.time(),
        "interval_s": 1e9,
    }
    with pytest.raises(SchemaError):
        decode_status(json.dumps(beat))
    beat["interval_s"] = 5.0
    assert decode_status(json.dumps(beat)).needs_weights is False  # type: ignore[union-attr]


# ---- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "env", "message"),
    [
        ({"weights_root": ["relative/dir"]}, {}, "weights_root must be an absolute directory"),
        ({"weights_root": [""]}, {}, "invalid --weights-root"),
        (
            {"weights_root": ["/w"], "allow_any_weights_path": True},
            {},
            "weights_root and allow_any_weights_path exclude each other",
        ),
        ({}, {"VKW_WEIGHTS_ROOT": "/w:relative"}, "weights_root must be an absolute directory"),
        ({"control_hmac_key": "short"}, {}, "invalid --control-hmac-key: Expected `str` of length"),
        ({}, {"VKW_CONTROL_HMAC_KEY": "short"}, "invalid VKW_CONTROL_HMAC_KEY"),
        ({"stale_weights_at_start": "maybe"}, {}, "invalid --stale-weights-at-start"),
        ({"allow_weight_transfer": "perhaps"}, {}, "invalid --allow-weight-transfer"),
    ],
)
def test_bad_security_settings_fail_with_one_line(values, env, message):
    with pytest.raises(ConfigError) as info:
        settings_from(values, env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert "short" not in str(info.value)  # a key, even a bad one, is never echoed


def test_security_settings_from_flags_and_env():
    s = settings_from({}, {"VKW_WEIGHTS_ROOT": "/a:/b", "VKW_CONTROL_HMAC_KEY": "s" * 40})
    assert s.weights_root == ("/a", "/b")
    assert "control_hmac_key" in SECRET_FIELDS
    assert "s" * 40 not in repr(s) and s.redacted()["control_hmac_key"] == "***"
    default = settings_from({}, {})
    assert default.weights_root == () and not default.allow_any_weights_path
    assert not default.allow_remote_code_updates and not default.allow_weight_transfer
    assert default.stale_weights_at_start == "hold"


def test_the_control_cli_builds_a_forced_update_and_takes_the_key_as_a_setting():
    from worker.cli.control import build_command  # noqa: PLC0415
    from worker.cli.main import build_parser  # noqa: PLC0415

    args = build_parser().parse_args(
        ["control", "update-weights", "/ckpt/step-1", "--version", "1", "--force"]
    )
    command = build_command(args, settings_from(args, {"VKW_CONTROL_HMAC_KEY": "k" * 20}))
    assert isinstance(command, UpdateWeights) and command.force
    args = build_parser().parse_args(["control", "update-weights", "/c", "--version", "1"])
    assert not build_command(args, settings_from(args, {})).force  # type: ignore[union-attr]
