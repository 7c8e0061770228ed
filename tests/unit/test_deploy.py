"""The fleet's manifests, dashboard and alert rules agree with Kubernetes, KEDA and the worker."""

from __future__ import annotations

import copy
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import msgspec
import prometheus_client as prom
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from worker.core.config import (
    NOT_SETTINGS,
    SECRET_FIELDS,
    Settings,
    env_name,
    flag_name,
    settings_from,
)
from worker.core.metrics import LoopCounter, LoopHistogram, Metrics, MetricsServer

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "vllm-kafka-worker.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
# The oldest release with PodDisruptionBudget.unhealthyPodEvictionPolicy in GA.
KUBERNETES_VERSION = "1.31"
FIELDS = msgspec.structs.fields(Settings)
SETTING_ENV = {env_name(f.name) for f in FIELDS}
# Boolean settings also take --no-x-y (argparse.BooleanOptionalAction).
SETTING_FLAGS = {flag_name(f.name) for f in FIELDS} | {
    "--no-" + flag_name(f.name)[2:] for f in FIELDS if isinstance(f.default, bool)
}

# The fields of KEDA's ScaledObject (keda.sh/v1alpha1) and of its Kafka scaler's trigger
# metadata, as KEDA documents them (keda.sh/docs/2.x/reference/scaledobject-spec and
# scalers/apache-kafka): closed, so a misspelt or invented field fails here rather than being
# ignored by KEDA.
KAFKA_TRIGGER_METADATA = {
    "bootstrapServers",
    "consumerGroup",
    "topic",
    "lagThreshold",
    "activationLagThreshold",
    "offsetResetPolicy",
    "allowIdleConsumers",
    "scaleToZeroOnInvalidOffset",
    "excludePersistentLag",
    "limitToPartitionsWithLag",
    "ensureEvenDistributionOfPartitions",
    "partitionLimitation",
    "version",
    "sasl",
    "tls",
    "unsafeSsl",
}
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object"},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {"type": "object"},
                            },
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "kafka"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object", "required": ["name"]},
                            "metadata": {
                                "type": "object",
                                "required": ["bootstrapServers", "consumerGroup", "topic"],
                                "additionalProperties": False,
                                # KEDA reads every metadata value as a string.
                                "properties": {
                                    k: {"type": "string"} for k in KAFKA_TRIGGER_METADATA
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
# The Prometheus Operator's PodMonitor (monitoring.coreos.com/v1), the fields used here and
# their documented neighbours.
POD_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "namespaceSelector": {"type": "object"},
                "sampleLimit": {"type": "integer"},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object"},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "portNumber": {"type": "integer"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}
CUSTOM_RESOURCE_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT_SCHEMA,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR_SCHEMA,
}


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    return [
        doc
        for name in kustomization["resources"]
        for doc in yaml.safe_load_all((KUBERNETES / name).read_text())
        if doc
    ]


def the(kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in manifests() if doc["kind"] == kind]
    return found


def worker_container() -> dict[str, Any]:
    containers: list[dict[str, Any]] = the("StatefulSet")["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def settings_of_the_manifest() -> Settings:
    """The settings a worker of the StatefulSet starts with: literal values as written, the
    pod name for downward-API values and a placeholder for each secret."""
    environ = {}
    for name, entry in env_of(worker_container()).items():
        if "value" in entry:
            environ[name] = entry["value"]
        elif "fieldRef" in entry["valueFrom"]:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            environ[name] = "vllm-kafka-worker-0"
        else:
            environ[name] = "a-secret-of-sixteen-or-more-characters"
    return settings_from({}, environ)


# -- the manifests against Kubernetes and KEDA ---------------------------------------------


def test_the_kustomization_lists_every_manifest_in_its_folder() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    on_disk = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}

    assert sorted(kustomization["resources"]) == sorted(on_disk)
    assert {doc["kind"] for doc in manifests()} == {
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "ScaledObject",
        "PodMonitor",
    }


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_offline_against_its_schema(doc: dict[str, Any]) -> None:
    custom = CUSTOM_RESOURCE_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if custom is not None:
        jsonschema.validate(doc, custom)
    else:
        # Strict: a field Kubernetes does not know fails, as `kubectl apply` would refuse it.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kubernetes_validator_refuses_a_misspelt_field() -> None:
    statefulset = copy.deepcopy(the("StatefulSet"))
    pod = statefulset["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")

    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriodSecond"):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSION, strict=True)


def test_the_scaled_object_schema_refuses_a_field_the_kafka_scaler_does_not_document() -> None:
    scaled = copy.deepcopy(the("ScaledObject"))
    scaled["spec"]["triggers"][0]["metadata"]["lagTreshold"] = "512"

    with pytest.raises(jsonschema.ValidationError, match="lagTreshold"):
        jsonschema.validate(scaled, SCALED_OBJECT_SCHEMA)


def test_the_scaled_object_scales_the_statefulset_on_the_workers_lag() -> None:
    scaled = the("ScaledObject")["spec"]
    settings = settings_of_the_manifest()
    (trigger,) = scaled["triggers"]

    assert scaled["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": the("StatefulSet")["metadata"]["name"],
    }
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["bootstrapServers"] == settings.bootstrap_servers
    assert trigger["metadata"]["consumerGroup"] == settings.group_id
    assert trigger["metadata"]["topic"] == settings.jobs_topic
    # A worker's lag includes what it has in flight (uncommitted): the target must exceed it.
    assert int(trigger["metadata"]["lagThreshold"]) > 2 * max_num_seqs(worker_container())
    assert trigger["metadata"]["offsetResetPolicy"] == "earliest"
    assert scaled["minReplicaCount"] >= 1


def test_the_scaled_objects_behavior_is_a_valid_hpa_behavior() -> None:
    """KEDA hands `advanced.horizontalPodAutoscalerConfig.behavior` to the HPA it creates as it
    is: validate it inside one."""
    behavior = the("ScaledObject")["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "vllm-kafka-worker"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "w"},
            "maxReplicas": 8,
            "behavior": behavior,
        },
    }

    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 600


def max_num_seqs(container: dict[str, Any]) -> int:
    engine_args = container["args"][container["args"].index("--") + 1 :]
    return int(engine_args[engine_args.index("--max-num-seqs") + 1])


# -- the manifests against the worker's settings -------------------------------------------


def test_every_env_var_and_flag_of_the_manifests_is_a_worker_setting() -> None:
    container = worker_container()
    env = set(env_of(container))
    args = container["args"]
    worker_flags = [a for a in args[: args.index("--")] if a.startswith("-")]

    assert args[0] == "serve"
    assert env <= SETTING_ENV, env - SETTING_ENV
    assert not env & NOT_SETTINGS
    assert set(worker_flags) <= SETTING_FLAGS, set(worker_flags) - SETTING_FLAGS
    # Values too: the worker would start with these (bad values raise ConfigError).
    settings = settings_of_the_manifest()
    assert settings.group_instance_id == "vllm-kafka-worker-0"
    assert settings.metrics_port == 9400


def test_the_group_instance_id_is_the_pod_name() -> None:
    entry = env_of(worker_container())[env_name("group_instance_id")]

    assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_secrets_come_from_the_secret_and_only_from_it() -> None:
    env = env_of(worker_container())
    secret_envs = {env_name(f) for f in SECRET_FIELDS}

    assert secret_envs <= env.keys()
    for name in secret_envs:
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert "value" not in env[name]
        assert ref["name"] == "vllm-kafka-worker-secrets"
        assert ref["key"] == name
    # The control key is required: without it any writer of the control topic steers the fleet.
    assert not env[env_name("control_hmac_key")]["valueFrom"]["secretKeyRef"].get("optional")


def test_the_grace_period_outlasts_the_workers_drain() -> None:
    settings = settings_of_the_manifest()
    pod = the("StatefulSet")["spec"]["template"]["spec"]
    # The grace for jobs in flight, then the flush, the final commit and closing.
    drain_s = settings.shutdown_grace_s + 3 * settings.close_timeout_s

    assert pod["terminationGracePeriodSeconds"] == 90
    assert pod["terminationGracePeriodSeconds"] > drain_s


def test_the_probes_ask_the_metrics_server_on_its_port() -> None:
    container = worker_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    settings = settings_of_the_manifest()
    server = MetricsServer(Metrics(), "127.0.0.1", 0, is_ready=lambda: True)
    liveness = container["livenessProbe"]["httpGet"]
    readiness = container["readinessProbe"]["httpGet"]

    assert (liveness["path"], readiness["path"]) == ("/healthz", "/readyz")
    for probe in (liveness, readiness):
        assert ports[probe["port"]] == settings.metrics_port
        assert server.respond(probe["path"])[0] == 200
    assert server.respond("/nothing")[0] == 404  # the paths above are real routes


def test_the_weights_root_is_mounted_read_only_from_a_read_only_claim() -> None:
    settings = settings_of_the_manifest()
    pod = the("StatefulSet")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in worker_container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    assert settings.weights_root == ("/weights",)
    for root in settings.weights_root:
        assert mounts[root]["readOnly"] is True
        assert volumes[mounts[root]["name"]]["persistentVolumeClaim"]["readOnly"] is True


def test_each_worker_asks_for_one_gpu() -> None:
    resources = worker_container()["resources"]

    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1


def test_service_budget_and_monitor_select_the_workers_pods() -> None:
    statefulset = the("StatefulSet")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    service = the("Service")
    monitor = the("PodMonitor")["spec"]
    port_names = {p["name"] for p in worker_container()["ports"]}

    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    for selector in (
        service["spec"]["selector"],
        the("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        statefulset["spec"]["selector"]["matchLabels"],
        monitor["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items()
    assert {e["port"] for e in monitor["podMetricsEndpoints"]} <= port_names
    # The rules and the dashboard select job="vllm-kafka-worker": the monitor's jobLabel names it.
    assert pod_labels[monitor["jobLabel"]] == "vllm-kafka-worker"


# -- the dashboard and the rules against the worker's metrics ------------------------------

METRIC_NAME = re.compile(r"\bvkw_[A-Za-z0-9_:]*")
# The names Prometheus stores a family's samples under, by the family's type.
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


def scrape() -> str:
    """A just-started worker's /metrics, read over HTTP as Prometheus reads it."""
    metrics = Metrics()
    server = MetricsServer(metrics, "127.0.0.1", 0)
    server.start()
    try:
        url = f"http://127.0.0.1:{server.bound_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text: str = reply.read().decode()
    finally:
        server.stop()
    return text


def exported_series() -> dict[str, str]:
    """Series name -> family, from a scrape of the worker's /metrics over HTTP."""
    series = {}
    for family in text_string_to_metric_families(scrape()):
        for suffix in SERIES_SUFFIXES[family.type]:
            series[family.name + suffix] = family.name
    return series


def dashboard_expressions() -> list[str]:
    def panels(within: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # A collapsed row keeps its panels inside it.
        return [p for panel in within for p in (panel, *panels(panel.get("panels", [])))]

    dashboard = json.loads(DASHBOARD.read_text())
    return [
        target["expr"]
        for panel in panels(dashboard["panels"])
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def named_metrics(expressions: list[str]) -> set[str]:
    return {name for expr in expressions for name in METRIC_NAME.findall(expr)}


def test_the_scrape_yields_the_families_with_the_names_prometheus_stores() -> None:
    series = exported_series()

    assert series["vkw_jobs_total"] == "vkw_jobs"
    assert series["vkw_engine_seconds_bucket"] == "vkw_engine_seconds"
    assert series["vkw_consumer_lag"] == "vkw_consumer_lag"
    assert "vkw_jobs" not in series  # a counter is stored under its _total name only


def test_the_dashboard_and_the_rules_name_only_metrics_the_worker_exports() -> None:
    series = exported_series()
    expressions = dashboard_expressions() + [rule["expr"] for rule in rules()]

    unknown = named_metrics(expressions) - series.keys()

    assert expressions
    assert not unknown, f"not exported by the worker: {sorted(unknown)}"


SELECTOR = re.compile(r"\b(vkw_[A-Za-z0-9_:]*)\{([^}]*)\}")
LABEL_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
# Labels Prometheus adds to every series it scrapes.
PROMETHEUS_LABELS = {"job", "instance"}
# A counter a rule waits to rise, with its selector's label matchers.
INCREASE = re.compile(r"increase\((vkw_\w+)\{([^}]*)\}\[")
MATCHER = re.compile(r'(\w+)\s*(!=|=)\s*"([^"]*)"')


def family_labels() -> dict[str, set[str]]:
    """Family name -> its label names, from the worker's metrics themselves (a scrape shows a
    labelled family's labels only once a series of it exists)."""
    labels = {}
    for metric in vars(Metrics()).values():
        if isinstance(metric, LoopCounter):
            labels[metric.name] = set(metric.labelnames)
        elif isinstance(metric, LoopHistogram):
            labels[metric.name] = {"le"}
        elif isinstance(metric, prom.metrics.MetricWrapperBase):
            names = set(metric._labelnames)
            labels[metric._name] = names | ({"le"} if isinstance(metric, prom.Histogram) else set())
    return labels


def test_the_dashboard_and_the_rules_select_only_labels_the_worker_exports() -> None:
    series = exported_series()
    labels = family_labels()
    expressions = dashboard_expressions() + [rule["expr"] for rule in rules()]
    selected = [
        (name, label)
        for expr in expressions
        for name, matchers in SELECTOR.findall(expr)
        for label in LABEL_MATCHER.findall(matchers)
    ]

    unknown = {
        f"{name}{{{label}}}"
        for name, label in selected
        if label not in labels[series[name]] | PROMETHEUS_LABELS
    }

    assert len(selected) > len(expressions)
    assert not unknown, f"labels the worker does not export: {sorted(unknown)}"


def test_every_counter_an_alert_waits_to_rise_reads_zero_from_a_workers_start() -> None:
    """Prometheus counts no increase into a series' first sample (prometheus/prometheus
    `promql/functions.go`, `extrapolatedRate`: a range with fewer than two samples gives
    nothing), and a labelled series appears only once its label values are used
    (prometheus/client_python `docs/content/instrumenting/labels.md`: "Metrics with labels are
    not initialized when declared ... initialize the label values by calling the .labels()
    method alone"). A series born by the increment an alert waits for, such as a restarted
    worker's first crash-looped job, would raise no alert: each must read 0 from the start."""
    samples = [s for family in text_string_to_metric_families(scrape()) for s in family.samples]
    watched = [
        (found.group(1), MATCHER.findall(found.group(2)))
        for rule in rules()
        for found in INCREASE.finditer(rule["expr"])
    ]

    assert len(watched) >= 4
    for name, matchers in watched:
        selected = [
            sample.value
            for sample in samples
            if sample.name == name
            and all(
                (sample.labels.get(label, "") == value) == (op == "=")
                for label, op, value in matchers
                if label != "job"  # Prometheus's own, from the scrape
            )
        ]
        assert selected, f"{name}{{{matchers}}} is absent until it first rises"
        assert set(selected) == {0.0}, name


def test_the_dashboard_shows_what_an_operator_of_the_fleet_watches() -> None:
    series = exported_series()
    families = {series[name] for name in named_metrics(dashboard_expressions())}

    assert {
        "vkw_consumer_lag",
        "vkw_jobs",
        "vkw_crash_suspects",
        "vkw_engine_seconds",
        "vkw_publish_seconds",
        "vkw_weight_version",
        "vkw_needs_weights",
        "vkw_commands",
        "vkw_commits",
        "vkw_offset_map_degraded",
    } <= families


def test_the_rules_cover_the_fleets_failures() -> None:
    by_name = {rule["alert"]: rule for rule in rules()}

    assert {
        "VkwWorkerDown",
        "VkwLagGrowing",
        "VkwNoProgress",
        "VkwCrashLoopedJobs",
        "VkwWeightVersionSkew",
        "VkwWeightUpdateFailed",
        "VkwDeadLetters",
        "VkwCommitsFailing",
        "VkwNeedsWeights",
    } <= by_name.keys()
    for name, rule in by_name.items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert rule["annotations"]["summary"], name
        assert 'job="vllm-kafka-worker"' in rule["expr"], name
    # Skew during a rollout is expected; only skew that outlasts one is an alert.
    assert by_name["VkwWeightVersionSkew"]["for"] == "10m"


@pytest.mark.parametrize("expr", [*dashboard_expressions(), *(r["expr"] for r in rules())])
def test_every_expression_closes_its_brackets_and_quotes(expr: str) -> None:
    # No PromQL parser on PyPI runs offline here; this catches the slips hand edits make.
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    for char in without_strings:
        if char in depth:
            depth[char] += 1
        elif char in closing:
            depth[closing[char]] -= 1
            assert depth[closing[char]] >= 0, expr
    assert depth == {"(": 0, "{": 0, "[": 0}, expr
    assert expr.count('"') % 2 == 0, expr
