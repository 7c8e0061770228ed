"""docker-compose.yml's structure (no Docker engine here to run it)."""

import tomllib
from pathlib import Path

import yaml

from worker.core.config import DEFAULT_MAX_RESULT_BYTES, Settings, env_name
from worker.core.kafka import RECORD_OVERHEAD_BYTES

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
RECORD_LIMIT = DEFAULT_MAX_RESULT_BYTES + RECORD_OVERHEAD_BYTES


def test_services_are_kafka_topic_creation_and_a_gpu_worker():
    assert set(SERVICES) == {"kafka", "kafka-init", "worker"}
    assert SERVICES["kafka"]["image"].startswith("apache/kafka:")
    assert "9092:9092" in SERVICES["kafka"]["ports"]
    devices = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert SERVICES["worker"]["build"] == "."


def test_the_image_is_built_on_the_vllm_release_the_gpu_extra_pins():
    (base,) = [
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("FROM ")
    ]
    image, tag = base.split(":")
    assert image == "vllm/vllm-openai"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (gpu,) = [r for r in extras["gpu"] if r.startswith("vllm")]
    low, high = gpu.removeprefix("vllm>=").split(",<")  # e.g. vllm>=0.32,<0.33
    version = tuple(int(p) for p in tag.removeprefix("v").split("."))
    assert tuple(int(p) for p in low.split(".")) <= version < tuple(int(p) for p in high.split("."))


def test_kafka_is_single_node_kraft_reachable_from_host_and_containers():
    env = SERVICES["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "HOST://localhost:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "INTERNAL://kafka:29092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) >= RECORD_LIMIT


def test_topics_are_created_with_max_message_bytes_sized_for_results():
    init = SERVICES["kafka-init"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert int(init["environment"]["RECORD_LIMIT"]) >= RECORD_LIMIT
    script = init["command"][0]
    assert "max.message.bytes" in script
    defaults = {
        f: Settings.__struct_defaults__[i] for i, f in enumerate(Settings.__struct_fields__)
    }
    for topic in ("jobs_topic", "results_topic", "dead_letter_topic"):
        assert defaults[topic] in script
    for topic in ("control_topic", "status_topic"):
        assert defaults[topic] in script


def test_worker_env_uses_real_settings_and_waits_for_topics():
    worker = SERVICES["worker"]
    assert worker["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
    known = {env_name(f) for f in Settings.__struct_fields__}
    settings_env = {k for k in worker["environment"] if k.startswith("VKW_")}
    assert settings_env <= known
    assert worker["environment"]["VKW_BOOTSTRAP_SERVERS"] == "kafka:29092"
    assert f"{worker['environment']['VKW_METRICS_PORT']}:9400" in worker["ports"]
    assert worker["command"][:2] == ["serve", "--"]


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60}
    return float(duration[:-1]) * units[duration[-1]]


def test_docker_lets_the_worker_drain_before_it_kills_it():
    # Docker's default stop_grace_period (10 s) is shorter than --shutdown-grace-s: its SIGKILL
    # would cut the drain short, and every job still running would be redelivered.
    settings = Settings()
    stop_grace = _seconds(SERVICES["worker"]["stop_grace_period"])
    assert stop_grace > settings.shutdown_grace_s + settings.close_timeout_s
