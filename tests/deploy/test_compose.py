"""docker-compose.yml against the Compose Specification schema, and what it must mean.

The schema is the official compose-spec.json (github.com/compose-spec/compose-spec,
schema/compose-spec.json, Apache-2.0) as vendored, with its license, by the
check-jsonschema package (a pinned dev dependency): no network needed.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from importlib import resources
from typing import Any

import jsonschema
import pytest
import yaml

from kvplan.server.config import parse_settings
from tests.deploy import parsing
from tests.deploy.parsing import COMPOSE_FILE, PROMETHEUS_CONFIG, ROOT

VENDOR = "check_jsonschema.builtin_schemas.vendor"


def compose_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(
        resources.files(VENDOR).joinpath("compose-spec.json").read_text()
    )
    return schema


@functools.cache
def compose_validator() -> jsonschema.protocols.Validator:
    schema = compose_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return data


def schema_errors(document: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
        for error in compose_validator().iter_errors(document)
    ]


def container_env() -> dict[str, str]:
    """What the planner container sees: the image's ENV, then compose's environment."""
    env = {k: v for k, v in parsing.env().items() if k.startswith("KVPLAN_")}
    overrides = compose()["services"]["planner"].get("environment", {})
    assert isinstance(overrides, dict), "use the mapping form for environment"
    for key, value in overrides.items():
        env[key] = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))  # compose defaults
    return env


def test_schema_is_the_compose_specification() -> None:
    schema = compose_schema()
    assert schema["title"] == "Compose Specification"
    license_text = resources.files(VENDOR).joinpath("licenses/LICENSE.compose-spec").read_text()
    assert "Apache License" in license_text


def test_compose_file_is_valid() -> None:
    errors = schema_errors(compose())
    assert errors == [], "\n".join(errors)


@pytest.mark.parametrize(
    "breakage",
    ["unknown service key", "ports as a mapping", "healthcheck test as a number"],
)
def test_schema_rejects_a_broken_file(breakage: str) -> None:
    """A negative control: the validation above can fail."""
    document = copy.deepcopy(compose())
    planner = document["services"]["planner"]
    if breakage == "unknown service key":
        planner["healthchek"] = planner.pop("healthcheck")
    elif breakage == "ports as a mapping":
        planner["ports"] = {"50051": 50051}
    else:
        planner["healthcheck"]["test"] = 42
    assert schema_errors(document)


def test_planner_service() -> None:
    planner = compose()["services"]["planner"]
    build = planner["build"]
    context = build if isinstance(build, str) else build.get("context", ".")
    assert (ROOT / context / "Dockerfile").resolve() == parsing.DOCKERFILE
    assert planner["restart"] in ("always", "unless-stopped", "on-failure")
    env = container_env()
    settings = parse_settings([], environ=env)
    assert settings.log_format == "json"
    published = {str(port) for port in planner["ports"]}
    assert published == {f"{settings.port}:{settings.port}", "9464:9464"}
    assert {settings.port, settings.metrics_port} == parsing.exposed_ports()


def test_planner_healthcheck_reuses_kvplan_health() -> None:
    healthcheck = compose()["services"]["planner"]["healthcheck"]
    _, image_command = parsing.healthcheck()
    assert healthcheck["test"] == ["CMD", *image_command]
    assert healthcheck["test"][1:3] == ["kvplan", "health"]
    assert int(healthcheck["retries"]) >= 1


def test_state_directory_is_a_volume_in_the_image_and_in_compose() -> None:
    """The SQLite store must outlive the container: the image declares its state
    directory a volume and compose mounts a named volume there."""
    state_dir = parsing.env()["KVPLAN_STATE_DIR"]
    assert state_dir == "/var/lib/kvplan"
    assert parsing.exec_form(parsing.last("VOLUME").args) == [state_dir]
    planner = compose()["services"]["planner"]
    mounts = [
        str(v) if isinstance(v, str) else v.get("target", "") for v in planner.get("volumes", [])
    ]
    assert f"planner-state:{state_dir}" in mounts
    assert "planner-state" in compose()["volumes"]
    assert planner["environment"]["KVPLAN_STORE"] == "${KVPLAN_STORE:-}"


def test_prometheus_scrapes_the_planner_metrics_port() -> None:
    document = compose()
    prometheus = document["services"]["prometheus"]
    image, _, tag = prometheus["image"].rpartition(":")
    assert image == "prom/prometheus"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), f"pin a release tag, not {tag!r}"
    config_mount = next(
        v for v in prometheus["volumes"] if str(v).split(":")[1] == "/etc/prometheus/prometheus.yml"
    )
    assert (ROOT / str(config_mount).split(":")[0]).resolve() == PROMETHEUS_CONFIG
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus.get("command", [])
    assert prometheus["depends_on"]["planner"]["condition"] == "service_healthy"

    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    metrics_port = parse_settings([], environ=container_env()).metrics_port
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    ]
    assert f"planner:{metrics_port}" in targets
    hosts = {target.rpartition(":")[0] for target in targets}
    assert hosts <= set(document["services"]), "scrape targets must be compose services"
    job = next(j for j in config["scrape_configs"] if "planner:9464" in str(j))
    assert job.get("metrics_path", "/metrics") == "/metrics"
