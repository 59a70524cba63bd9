"""deploy/kubernetes rendered by kubectl's kustomize, every object validated against
the Kubernetes 1.36 and 1.37 schemas (kubernetes-validate's bundled ones, offline),
and what the objects must mean: the security context, the probes, the selectors.

Combinations: each overlay alone, with each component alone, and with all of them
(once with the ServiceMonitor, once with the PodMonitor: one scrapes the other's
targets, so they are alternatives). The components touch disjoint objects, so a
pair that works alone and in the full set works in any subset.
"""

from __future__ import annotations

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
# Custom resources: no schema in kubernetes-validate; checked field by field below.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "Certificate"}


def component_sets(overlay: str) -> list[tuple[str, ...]]:
    usable = [c for c in COMPONENTS if c != "external-redis" or overlay == "replicated"]
    full = [c for c in usable if c != "pod-monitor"]
    sets: list[tuple[str, ...]] = [(), *((c,) for c in usable), tuple(full)]
    sets.append(tuple(c if c != "service-monitor" else "pod-monitor" for c in full))
    return sets


CASES = [(overlay, components) for overlay in OVERLAYS for components in component_sets(overlay)]


def _render(case: tuple[str, tuple[str, ...]], scratch: Path) -> list[dict[str, Any]]:
    overlay, components = case
    directory = scratch / f"{overlay}-{'+'.join(components) or 'plain'}"
    directory.mkdir()
    # kustomize refuses absolute paths: point at the repository relative to here.
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUBERNETES / "overlays" / overlay, directory)],
        "components": [
            os.path.relpath(KUBERNETES / "components" / c, directory) for c in components
        ],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    rendered = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, f"kubectl kustomize {case}: {rendered.stderr}"
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, list[dict[str, Any]]]:
    scratch = tmp_path_factory.mktemp("kustomize")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda case: _render(case, scratch), CASES))
    return dict(zip(CASES, results, strict=True))


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
    rendered: dict[Any, list[dict[str, Any]]],
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


def test_every_container_runs_locked_down(rendered: dict[Any, list[dict[str, Any]]]) -> None:
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
    rendered: dict[Any, list[dict[str, Any]]], tmp_path: Path
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
    rendered: dict[Any, list[dict[str, Any]]],
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
    rendered: dict[Any, list[dict[str, Any]]],
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
    rendered: dict[Any, list[dict[str, Any]]], tmp_path: Path
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
    rendered: dict[Any, list[dict[str, Any]]], tmp_path: Path
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
