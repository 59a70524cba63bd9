"""deploy/kubernetes rendered by kubectl's kustomize, every object validated against
the Kubernetes 1.36 and 1.37 schemas (kubernetes-validate's bundled ones, offline) and
every custom resource against its own published CRD (tests/deploy/crds), and what the
objects must mean: the security context, the probes, the selectors.

Combinations: every overlay with every subset of the components it takes (the power
set), less the subsets holding both the ServiceMonitor and the PodMonitor: they are
documented alternatives (each would scrape every planner once more). 24 sets on
`single` (no external-redis: it replaces the replicated overlay's Redis), 48 on
`replicated`. kubectl renders them all in one run, each set in a namespace of its
own (one kubectl start instead of 72); a few sets are rendered alone as well, and
must come out the same but for the namespace.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvplan.client.vllm_plugin.settings import Mode
from kvplan.client.vllm_plugin.settings import Settings as PluginSettings
from kvplan.server.config import parse_settings
from kvplan.server.probes import open_probe
from tests.deploy.crd_schemas import crd_errors
from tests.deploy.tools import DASHBOARD, KUBERNETES, RULES_FILE, debian_prometheus_binary, kubectl

KUBERNETES_VERSIONS = ("1.36.0", "1.37.0")
OVERLAYS = ("single", "replicated")
COMPONENTS = (
    "cert-manager",
    "service-monitor",
    "pod-monitor",
    "prometheus-rule",
    "grafana-dashboard",
    "external-redis",
)
ALTERNATIVES = {"service-monitor", "pod-monitor"}
# Custom resources: validated against the CRDs in tests/deploy/crds.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "Certificate"}

Case = tuple[str, tuple[str, ...]]


def component_sets(overlay: str) -> list[tuple[str, ...]]:
    usable = [c for c in COMPONENTS if c != "external-redis" or overlay == "replicated"]
    subsets = itertools.chain.from_iterable(
        itertools.combinations(usable, size) for size in range(len(usable) + 1)
    )
    return [s for s in subsets if not set(s) >= ALTERNATIVES]


CASES: list[Case] = [
    (overlay, components) for overlay in OVERLAYS for components in component_sets(overlay)
]
# Rendered alone too: both bare overlays and the largest sets.
ALONE: list[Case] = [
    ("single", ()),
    ("replicated", ()),
    max((c for c in CASES if c[0] == "single"), key=lambda c: len(c[1])),
    max((c for c in CASES if c[0] == "replicated"), key=lambda c: len(c[1])),
]


def _kustomization(case: Case, directory: Path, namespace: str | None) -> None:
    overlay, components = case
    directory.mkdir()
    # kustomize refuses absolute paths: point at the repository relative to here.
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUBERNETES / "overlays" / overlay, directory)],
        "components": [
            os.path.relpath(KUBERNETES / "components" / c, directory) for c in components
        ],
    }
    if namespace is not None:
        kustomization["namespace"] = namespace
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    rendered = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert rendered.returncode == 0, f"kubectl kustomize {directory}: {rendered.stderr}"
    # libyaml: 72 sets are 1.4 MB of YAML, ten times slower to read in pure Python.
    return [doc for doc in yaml.load_all(rendered.stdout, Loader=yaml.CSafeLoader) if doc]


def _without_namespace(obj: dict[str, Any]) -> dict[str, Any]:
    obj = json.loads(json.dumps(obj))
    obj["metadata"].pop("namespace", None)
    return obj


def _by_identity(objects: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(objects, key=lambda o: (o["apiVersion"], o["kind"], o["metadata"]["name"]))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[Case, list[dict[str, Any]]]:
    scratch = tmp_path_factory.mktemp("kustomize")
    namespaces = {f"case-{number}": case for number, case in enumerate(CASES)}
    for namespace, case in namespaces.items():
        _kustomization(case, scratch / namespace, namespace)
    (scratch / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": list(namespaces)})  # every set, one kubectl run
    )
    by_case: dict[Case, list[dict[str, Any]]] = {case: [] for case in CASES}
    for obj in _kustomize(scratch):
        namespace = obj["metadata"].get("namespace")
        assert namespace in namespaces, f"cluster-scoped {obj['kind']} {obj['metadata']['name']}"
        by_case[namespaces[namespace]].append(_without_namespace(obj))

    def alone(number_and_case: tuple[int, Case]) -> list[dict[str, Any]]:
        number, case = number_and_case
        directory = scratch / f"alone-{number}"
        _kustomization(case, directory, None)
        return _kustomize(directory)

    with ThreadPoolExecutor(max_workers=2) as pool:
        singles = list(pool.map(alone, enumerate(ALONE)))
    for case, objects in zip(ALONE, singles, strict=True):
        assert _by_identity(objects) == _by_identity(by_case[case]), case
    return by_case


def test_every_combination_is_rendered(rendered: dict[Case, list[dict[str, Any]]]) -> None:
    assert len(rendered) == 24 + 48
    assert all(rendered.values())


def find(objects: Sequence[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {len(matches)}"
    return matches[0]


def planner(objects: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "StatefulSet", "kvplan")


def container_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_every_object_is_valid_in_two_kubernetes_releases(
    rendered: dict[Case, list[dict[str, Any]]],
) -> None:
    # The cases share most objects: each distinct one is validated once per release.
    distinct = {
        json.dumps(obj, sort_keys=True): obj
        for objects in rendered.values()
        for obj in objects
        if obj["kind"] not in CUSTOM_KINDS
    }
    for version in KUBERNETES_VERSIONS:
        for obj in distinct.values():
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {error}")
    wanted = {
        "cert-manager": "Certificate",
        "service-monitor": "ServiceMonitor",
        "pod-monitor": "PodMonitor",
        "prometheus-rule": "PrometheusRule",
    }
    for (_, components), objects in rendered.items():
        custom = {o["kind"] for o in objects} & CUSTOM_KINDS
        assert custom == {wanted[c] for c in components if c in wanted}
    custom_objects = {
        json.dumps(obj, sort_keys=True): obj
        for objects in rendered.values()
        for obj in objects
        if obj["kind"] in CUSTOM_KINDS
    }
    assert {o["kind"] for o in custom_objects.values()} == CUSTOM_KINDS
    for obj in custom_objects.values():
        errors = crd_errors(obj)
        assert not errors, f"{obj['kind']}/{obj['metadata']['name']}: {errors}"


def test_the_crd_validation_does_find_problems() -> None:
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "kvplan"},
        "spec": {"selector": {}, "endpoints": [{"port": "metrics", "intervall": "15s"}]},
    }
    assert crd_errors(monitor) == [
        "spec.endpoints.0: Additional properties are not allowed ('intervall' was unexpected)"
    ]
    certificate = {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": {"name": "kvplan"},
        "spec": {"issuerRef": {"name": "ca"}},
    }
    assert crd_errors(certificate) == ["spec: 'secretName' is a required property"]
    assert crd_errors({**certificate, "apiVersion": "cert-manager.io/v1alpha2"}) == [
        "no CRD in tests/deploy/crds serves cert-manager.io/v1alpha2 Certificate"
    ]


def test_every_container_runs_locked_down(rendered: dict[Case, list[dict[str, Any]]]) -> None:
    for case, objects in rendered.items():
        for workload in (o for o in objects if o["kind"] == "StatefulSet"):
            pod = workload["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, case
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            assert pod["automountServiceAccountToken"] is False
            for container in pod["containers"]:
                security = container["securityContext"]
                assert security["allowPrivilegeEscalation"] is False, case
                assert security["readOnlyRootFilesystem"] is True
                assert security["privileged"] is False
                assert security["capabilities"] == {"drop": ["ALL"]}
                assert security["seccompProfile"] == {"type": "RuntimeDefault"}
                assert pod["securityContext"]["runAsUser"] != 0
                limits, requests = (
                    container["resources"]["limits"],
                    container["resources"]["requests"],
                )
                assert set(limits) == set(requests) == {"cpu", "memory"}


def test_the_planner_is_probed_over_grpc_and_its_settings_parse(
    rendered: dict[Case, list[dict[str, Any]]], tmp_path: Path
) -> None:
    for case, objects in rendered.items():
        (container,) = planner(objects)["spec"]["template"]["spec"]["containers"]
        env = container_env(container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        # Every KVPLAN_* value parses as `kvplan serve` would read it.
        plain = {k: v for k, v in env.items() if isinstance(v, str)}
        settings = parse_settings([], plain)
        assert settings.health_port == ports["health"] != settings.port == ports["grpc"]
        assert settings.metrics_port == ports["metrics"]
        assert settings.metrics_host == settings.host == "0.0.0.0"
        # Liveness: the process ("" stays SERVING while the store is away); readiness:
        # the planner service, NOT_SERVING while the store is down or the server drains.
        assert container["livenessProbe"]["grpc"] == {"port": ports["health"], "service": ""}
        assert container["startupProbe"]["grpc"]["port"] == ports["health"]
        assert container["readinessProbe"]["grpc"] == {
            "port": ports["health"],
            "service": "kvplan.v1.KVCachePlanner",
        }
        # Credentials come from Secrets; the server is never exposed without them.
        volumes = {v["name"]: v for v in planner(objects)["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert volumes["tls"]["secret"]["secretName"] == "kvplan-tls"
        assert volumes["tokens"]["secret"]["secretName"] == "kvplan-tokens"
        assert settings.tls_cert == f"{mounts['tls']}/tls.crt"
        assert settings.token_file == f"{mounts['tokens']}/tokens"
        # The GPU inventory: a ConfigMap that kvplan's static probe reads as it is.
        assert (settings.probe, settings.devices) == ("static", f"{mounts['devices']}/devices.yaml")
        inventory = find(objects, "ConfigMap", volumes["devices"]["configMap"]["name"])
        inventory_file = tmp_path / "devices.yaml"
        inventory_file.write_text(inventory["data"]["devices.yaml"])
        probe = open_probe(settings.probe, str(inventory_file))
        uuids = [device.uuid for device in probe.snapshot()]
        assert uuids and all(uuid.startswith("GPU-") for uuid in uuids)
        if "cert-manager" in case[1]:
            certificate = find(objects, "Certificate")
            assert certificate["spec"]["secretName"] == "kvplan-tls"
            assert "kvplan" in certificate["spec"]["dnsNames"]


def test_the_topologies_keep_their_state_where_it_survives(
    rendered: dict[Case, list[dict[str, Any]]],
) -> None:
    single = rendered[("single", ())]
    statefulset = planner(single)
    assert statefulset["spec"]["replicas"] == 1
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    state_mount = next(
        m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]
    )
    assert state_mount["mountPath"] == container_env(container)["KVPLAN_STATE_DIR"]
    assert "KVPLAN_STORE" not in container_env(container)  # SQLite in the state directory
    assert all(v["name"] != "state" for v in statefulset["spec"]["template"]["spec"]["volumes"])

    replicated = rendered[("replicated", ())]
    statefulset = planner(replicated)
    assert statefulset["spec"]["replicas"] >= 2
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    redis = find(replicated, "StatefulSet", "kvplan-redis")
    redis_service = find(replicated, "Service", "kvplan-redis")
    assert container_env(container)["KVPLAN_STORE"] == "redis://kvplan-redis:6379/0"
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"  # kvplan refuses Redis without it
    assert selects(
        redis_service["spec"]["selector"], redis["spec"]["template"]["metadata"]["labels"]
    )
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    budget = find(replicated, "PodDisruptionBudget")
    assert selects(budget["spec"]["selector"]["matchLabels"], pod_labels)
    assert budget["spec"]["maxUnavailable"] < statefulset["spec"]["replicas"]
    spread = statefulset["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert {s["topologyKey"] for s in spread} >= {"kubernetes.io/hostname"}
    assert all(selects(s["labelSelector"]["matchLabels"], pod_labels) for s in spread)

    external = rendered[("replicated", ("external-redis",))]
    (container,) = planner(external)["spec"]["template"]["spec"]["containers"]
    store = next(e for e in container["env"] if e["name"] == "KVPLAN_STORE")
    assert store == {
        "name": "KVPLAN_STORE",
        "valueFrom": {"secretKeyRef": {"name": "kvplan-redis", "key": "url"}},
    }
    assert not [o for o in external if o["metadata"]["name"] == "kvplan-redis"]


def test_services_and_policies_select_what_they_name(
    rendered: dict[Case, list[dict[str, Any]]],
) -> None:
    for case, objects in rendered.items():
        statefulset = planner(objects)
        pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
        (container,) = statefulset["spec"]["template"]["spec"]["containers"]
        port_names = {p["name"] for p in container["ports"]}
        assert selects(statefulset["spec"]["selector"]["matchLabels"], pod_labels)
        grpc_service = find(objects, "Service", "kvplan")
        metrics_service = find(objects, "Service", "kvplan-metrics")
        for service, port in ((grpc_service, "grpc"), (metrics_service, "metrics")):
            assert selects(service["spec"]["selector"], pod_labels), case
            assert [p["targetPort"] for p in service["spec"]["ports"]] == [port]
        policy = find(objects, "NetworkPolicy", "kvplan")
        assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
        assert set(rules) == {"grpc", "metrics"} <= port_names  # nothing else gets in
        engine = {"kvplan.dev/client": "true"}
        scraper = {"app.kubernetes.io/name": "prometheus"}
        # Engines reach gRPC, from this namespace or a labelled one; never the metrics.
        assert any(selects(p["podSelector"]["matchLabels"], engine) for p in rules["grpc"])
        assert all(not selects(p["podSelector"]["matchLabels"], pod_labels) for p in rules["grpc"])
        for peer in rules["metrics"]:
            assert selects(peer["podSelector"]["matchLabels"], scraper)
            assert not selects(peer["podSelector"]["matchLabels"], engine)
            assert peer["namespaceSelector"]["matchLabels"] == {"kvplan.dev/monitoring": "true"}
        if "kvplan-redis" in {o["metadata"]["name"] for o in objects}:
            redis_policy = find(objects, "NetworkPolicy", "kvplan-redis")
            redis_pod = find(objects, "StatefulSet", "kvplan-redis")["spec"]["template"]
            assert selects(
                redis_policy["spec"]["podSelector"]["matchLabels"], redis_pod["metadata"]["labels"]
            )
            (only,) = redis_policy["spec"]["ingress"]
            assert [p["podSelector"]["matchLabels"] for p in only["from"]] == [
                statefulset["spec"]["selector"]["matchLabels"]
            ]
        if "service-monitor" in case[1]:
            monitor = find(objects, "ServiceMonitor")
            assert selects(
                monitor["spec"]["selector"]["matchLabels"], metrics_service["metadata"]["labels"]
            )
            assert not selects(
                monitor["spec"]["selector"]["matchLabels"], grpc_service["metadata"]["labels"]
            )
            assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
        if "pod-monitor" in case[1]:
            monitor = find(objects, "PodMonitor")
            assert selects(monitor["spec"]["selector"]["matchLabels"], pod_labels)
            assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_the_dashboard_and_rules_ship_as_their_files(
    rendered: dict[Case, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = rendered[("single", ("grafana-dashboard",))]
    config_map = find(objects, "ConfigMap", "kvplan-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
    assert json.loads(config_map["data"]["kvplan.json"]) == json.loads(DASHBOARD.read_text())

    rule = find(rendered[("single", ("prometheus-rule",))], "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"], (
        "run scripts/gen-prometheus-rule after editing deploy/prometheus/kvplan-rules.yaml"
    )
    extracted = tmp_path / "prometheus-rule.yaml"
    extracted.write_text(yaml.safe_dump(rule["spec"]))
    checked = subprocess.run(
        [debian_prometheus_binary("promtool"), "check", "rules", str(extracted)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_vllm_example_reaches_kvplan_in_lease_mode(
    rendered: dict[Case, list[dict[str, Any]]], tmp_path: Path
) -> None:
    rendered_example = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / "examples" / "vllm")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rendered_example.returncode == 0, rendered_example.stderr
    objects = [doc for doc in yaml.safe_load_all(rendered_example.stdout) if doc]
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)
    pod = find(objects, "Deployment")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = container_env(container)
    assert env["KVPLAN_ENGINE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The device plugin or the DRA driver decides what the container sees; a value in
    # the pod would override it (NVIDIA_VISIBLE_DEVICES=all exposes every GPU to a
    # legacy-mode runtime) or renumber CUDA's devices (docs/kubernetes.md#wiring-vllm).
    assert not {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & set(env)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

    # kvplan's NetworkPolicy admits this pod, and its address is kvplan's gRPC Service.
    kvplan_objects = rendered[("single", ())]
    policy = find(kvplan_objects, "NetworkPolicy", "kvplan")
    grpc_peers = next(
        r["from"] for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc"
    )
    assert any(
        selects(p["podSelector"]["matchLabels"], pod["metadata"]["labels"]) for p in grpc_peers
    )
    service = find(kvplan_objects, "Service", "kvplan")
    host, port = env["KVPLAN_ADDR"].rsplit(":", 1)
    assert host.split(".")[0] == service["metadata"]["name"]
    assert int(port) == service["spec"]["ports"][0]["port"]

    # The plugin reads these settings as they are, the Secrets' files standing in.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    files = {
        env["KVPLAN_CLIENT_TOKEN_FILE"]: b"engine-token\n",
        env["KVPLAN_TLS_CA"]: b"-----BEGIN CERTIFICATE-----\n",
    }
    plugin_env = {k: v for k, v in env.items() if isinstance(v, str)}
    plugin_env["KVPLAN_ENGINE_ID"] = "vllm-llama-0"
    for path, content in files.items():
        assert any(path.startswith(mount + "/") for mount in mounts.values()), path
        local = tmp_path / Path(path).name
        local.write_bytes(content)
        plugin_env = {k: (str(local) if v == path else v) for k, v in plugin_env.items()}
    settings = PluginSettings.from_env(plugin_env)
    assert settings.mode is Mode.LEASE and settings.engine_id == "vllm-llama-0"
    assert settings.security.token == "engine-token"
    assert settings.security.tls and settings.security.server_name == "kvplan.kvplan.svc"


# Measured figures of docs/deployment.md ("Memory and disk: the bounds"), bytes.
MB = 1_000_000
RSS_AT_REST = 55 * MB
BOOKKEEPING_PER_CACHED_PLAN = 1024
SQLITE_PAGE_CACHE = 2 * 1024 * 1024
# 365 ranks waiting at the 256 MiB bound: 346 MB RSS, 291 MB over rest (1.08x the bound).
RENDEZVOUS_RSS_PER_BOUND_BYTE = 291 / 268.435456
# 2,048 rank-mode calls at once: 186 MB RSS at most before the heap trim.
BURST_OVER_REST = 186 * MB - RSS_AT_REST


def _quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * factor
    return int(quantity)


def test_memory_requests_and_limits_follow_the_measured_bounds(
    rendered: dict[Case, list[dict[str, Any]]],
) -> None:
    """The request holds the planner with its caches full; the limit holds that plus
    the rendezvous bound filled, a burst of rank-mode calls and one largest call in
    and out, at the bounds the manifest's own settings give (raise a bound there and
    this asks for the limit to follow)."""
    for case, objects in rendered.items():
        (container,) = planner(objects)["spec"]["template"]["spec"]["containers"]
        env = container_env(container)
        settings = parse_settings([], {k: v for k, v in env.items() if isinstance(v, str)})
        steady = (
            RSS_AT_REST
            + settings.plan_cache_bytes
            + settings.plan_cache_size * BOOKKEEPING_PER_CACHED_PLAN
            + settings.model_cache_bytes
            + SQLITE_PAGE_CACHE
        )
        # The memory store keeps finished rank-mode results in the process too.
        in_process_results = settings.rendezvous_result_bytes if settings.store == "memory" else 0
        peak = (
            steady
            + in_process_results
            + settings.max_pending_rendezvous_bytes * RENDEZVOUS_RSS_PER_BOUND_BYTE
            + BURST_OVER_REST
            + 2 * settings.max_message_bytes
        )
        resources = container["resources"]
        request = _quantity_bytes(resources["requests"]["memory"])
        limit = _quantity_bytes(resources["limits"]["memory"])
        assert steady <= request, (case, steady, request)
        assert peak <= limit, (case, peak, limit)
