"""The dashboard and the alerts against reality: a real Prometheus (Debian's package)
scrapes a real `kvplan serve` on loopback every second while a short load runs
through it (uncached and cached plans, leases, a refused grant, a release, an expiry,
a Redis outage, during which the health service answers the manifests' readiness
probe NOT_SERVING and their liveness probe SERVING). Then every dashboard panel's
query and every alert's expression goes through Prometheus' HTTP query API, and each
must return series: a metric or label that the server does not export returns none
and fails the test."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplan.client import PlannerClient, PlannerError
from tests.deploy.tools import DASHBOARD, RULES_FILE, debian_prometheus_binary
from tests.server.redis_server import _dying_with_parent, free_port, running_redis
from tests.server.test_leases import leased_request

SCRAPE_INTERVAL = "1s"
# What Grafana puts in for the dashboard's variables: every job, and a rate window
# that holds several of this test's scrapes.
DASHBOARD_VARIABLES = {"$job": ".+", "$__rate_interval": "1m"}


@contextmanager
def process(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as output:
        child = subprocess.Popen(_dying_with_parent(command), stdout=output, stderr=output)
    try:
        yield child
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def wait_until(what: str, check: Any, timeout_s: float = 15.0, logs: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except (OSError, PlannerError, grpc.RpcError):
            value = None
        if value:
            return value
        time.sleep(0.1)
    detail = logs.read_text(errors="replace")[-3000:] if logs else ""
    raise AssertionError(f"timed out waiting for {what}\n{detail}")


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(panel title, query with the variables filled in, legend format)."""
    dashboard = json.loads(DASHBOARD.read_text())
    targets = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in DASHBOARD_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"an unknown variable in {panel['title']}: {expr}"
            targets.append((panel["title"], expr, target.get("legendFormat", "")))
    return targets


def dashboard_queries() -> list[tuple[str, str]]:
    return [(title, expr) for title, expr, _ in dashboard_targets()]


def groupings(expr: str) -> list[tuple[list[str], str]]:
    """Each `by (labels) (inner)` of the expression: the labels and the inner
    expression. A label the series lack still gives a result (one group, the label
    empty), so the series must be asked for it."""
    found = []
    for match in re.finditer(r"\bby\s*\(([^)]*)\)\s*\(", expr):
        depth, start = 1, match.end()
        end, quoted = start, False
        while depth:
            char = expr[end]
            if char == '"' and expr[end - 1] != "\\":
                quoted = not quoted
            elif not quoted:
                depth += {"(": 1, ")": -1}.get(char, 0)
            end += 1
        labels = [label.strip() for label in match.group(1).split(",") if label.strip()]
        found.append((labels, expr[start : end - 1]))
    return found


def test_groupings_are_found() -> None:
    expr = 'max by (a, b) (x{c="("} / y) + sum by (le) (rate(z[1m]))'
    assert groupings(expr) == [(["a", "b"], 'x{c="("} / y'), (["le"], "rate(z[1m])")]


def alert_expressions() -> list[tuple[str, str]]:
    """Each alert's expression with its final comparison made a `bool` one: the same
    series, whether or not the condition holds now."""
    expressions = []
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            expr, count = re.subn(
                r"(==|!=|>=|<=|>|<)\s*([0-9.e+-]+)\s*$", r"\1 bool \2", rule["expr"].strip()
            )
            assert count == 1, f"{rule['alert']}: no final comparison in {rule['expr']}"
            expressions.append((rule["alert"], expr))
    return expressions


def probe(health_target: str, service: str) -> str:
    """What kubelet's gRPC probe (readiness: the planner service; liveness: "") sees."""
    with grpc.insecure_channel(health_target) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def drive_load(
    target: str, health_target: str, prometheus: Prometheus, redis_stop: Any, redis_start: Any
) -> None:
    with PlannerClient(target, timeout_s=5) as client:
        uuid = client.list_devices().devices[0].uuid
        client.plan(leased_request("engine-a", uuid))  # uncached, granted
        client.plan(leased_request("engine-a", uuid))  # cached
        client.plan(leased_request("engine-b", uuid))  # the device is now 90% committed
        with pytest.raises(PlannerError) as refused:
            client.plan(leased_request("engine-c", uuid))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        client.release_plan("engine-b")
        with pytest.raises(PlannerError) as invalid:
            client.plan(leased_request("", uuid))  # a caller's mistake
        assert invalid.value.code is grpc.StatusCode.INVALID_ARGUMENT
        # engine-a never renews: its lease expires (TTL 1 s) and is swept.
        redis_stop()
        with pytest.raises(PlannerError) as outage:
            client.plan(leased_request("engine-d", uuid))
        assert outage.value.code is grpc.StatusCode.UNAVAILABLE
        # The health check sees it (every 0.2 s), a scrape records it.
        wait_until("the outage scraped", lambda: prometheus.query("kvplan_store_up == 0"))
        # The Deployment's probes: not ready while the store is down, but alive.
        assert probe(health_target, "kvplan.v1.KVCachePlanner") == "NOT_SERVING"
        assert probe(health_target, "") == "SERVING"
        redis_start()
        wait_until("the store back", lambda: client.plan(leased_request("engine-e", uuid)))
        # Ready again at a health tick after the store answers (kubelet probes again).
        wait_until(
            "ready again",
            lambda: probe(health_target, "kvplan.v1.KVCachePlanner") == "SERVING",
        )
        client.release_plan("engine-e")


def test_every_dashboard_query_and_alert_expression_returns_series(tmp_path: Path) -> None:
    prometheus_binary = debian_prometheus_binary("prometheus")
    kvplan = str(Path(sys.executable).parent / "kvplan")
    grpc_port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(RULES_FILE)],
        "scrape_configs": [
            {
                "job_name": "kvplan",
                "scrape_timeout": SCRAPE_INTERVAL,
                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    with running_redis(tmp_path, appendonly=True) as redis:
        serve = [
            kvplan,
            "serve",
            "--host=127.0.0.1",
            f"--port={grpc_port}",
            f"--metrics-port={metrics_port}",
            f"--store={redis.url}",
            f"--state-dir={tmp_path / 'state'}",
            "--devices=1xH100-80GB",
            "--lease-ttl-s=1",
            "--health-interval-s=0.2",
        ]
        prometheus_command = [
            prometheus_binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
            "--log.level=warn",
        ]
        server_log, prometheus_log = tmp_path / "kvplan.log", tmp_path / "prometheus.log"
        with process(serve, server_log), process(prometheus_command, prometheus_log):
            target = f"127.0.0.1:{grpc_port}"
            prometheus = Prometheus(prometheus_port)
            wait_until(
                "kvplan serving",
                lambda: PlannerClient(target, timeout_s=1).list_devices(),
                logs=server_log,
            )
            wait_until(
                "the first scrape",
                lambda: prometheus.query('up{job="kvplan"} == 1'),
                logs=prometheus_log,
            )
            # The manifests' health port shares the gRPC port's health service
            # (tests/server/test_security.py): asked here on the gRPC port, one port
            # fewer to find free on a busy machine.
            drive_load(target, target, prometheus, redis.stop, redis.start)
            # A few more scrapes after the load, so every rate() has two samples of it.
            time.sleep(2)

            failures = []
            for title, expr in dashboard_queries():
                if not prometheus.query(expr):
                    failures.append(f"dashboard panel {title!r}: {expr}")
            for alert, expr in alert_expressions():
                if not prometheus.query(expr):
                    failures.append(f"alert {alert}: {expr}")
            assert not failures, "no series for:\n" + "\n".join(failures)

            # Every label a query groups by, and every one a legend shows, is on
            # every series it reads.
            for name, expr in [*dashboard_queries(), *alert_expressions()]:
                for labels, inner in groupings(expr):
                    for series in prometheus.query(f"count by ({', '.join(labels)}) ({inner})"):
                        missing = [label for label in labels if not series["metric"].get(label)]
                        assert not missing, f"{name}: no {missing} on the series of {inner}"
            for title, expr, legend in dashboard_targets():
                for series in prometheus.query(expr):
                    for label in re.findall(r"{{\s*(\w+)\s*}}", legend):
                        assert series["metric"].get(label), f"{title}: legend {{{{{label}}}}}"

            # What the load did shows in the series the panels read.
            assert prometheus.query('max_over_time(kvplan_store_up{job="kvplan"}[1m]) == 1')
            assert prometheus.query('min_over_time(kvplan_store_up{job="kvplan"}[1m]) == 0')
            assert prometheus.query(
                'kvplan_leases_ended_total{job="kvplan", reason="expired"} >= 1'
            )
            assert prometheus.query('kvplan_grants_refused_total{job="kvplan"} >= 1')
            assert prometheus.query("kvplan_plan_cache_hits_total >= 1")
            # Prometheus evaluated every rule without an error.
            groups = prometheus.get("/api/v1/rules")["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            assert len(rules) == len(alert_expressions())
            assert all(rule["health"] == "ok" for rule in rules), rules


def test_the_dashboard_has_a_stable_uid_and_a_templated_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvplan-overview"  # links and provisioning rely on it
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    templated = {"type": "prometheus", "uid": "${datasource}"}
    for panel in dashboard["panels"]:
        assert panel["datasource"] == templated, panel["title"]
        assert panel["targets"] and all(t["datasource"] == templated for t in panel["targets"])
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
