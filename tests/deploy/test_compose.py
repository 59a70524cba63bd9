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
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvplan.server.config import parse_settings
from kvplan.server.security import bind_host
from tests.deploy import parsing
from tests.deploy.parsing import COMPOSE_FILE, COMPOSE_TOKENS_FILE, PROMETHEUS_CONFIG, ROOT

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


def compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def merged(base: Any, overlay: Any) -> Any:
    """Enough of compose's merge of `-f base -f overlay` for these files: mappings
    merge key by key, sequences gain the overlay's new items, the rest is replaced."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        result = dict(base)
        for key, value in overlay.items():
            result[key] = merged(base[key], value) if key in base else value
        return result
    if isinstance(base, list) and isinstance(overlay, list):
        return base + [item for item in overlay if item not in base]
    return overlay


def with_tokens() -> dict[str, Any]:
    """docker compose -f docker-compose.yml -f docker-compose.tokens.yml"""
    document: dict[str, Any] = merged(compose(), compose(COMPOSE_TOKENS_FILE))
    return document


def compose_default(value: object) -> str:
    """A value as compose reads it when the variables are unset: ${VAR:-default}."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def schema_errors(document: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"
        for error in compose_validator().iter_errors(document)
    ]


def container_env(document: dict[str, Any] | None = None) -> dict[str, str]:
    """What the planner container sees: the image's ENV, then compose's environment."""
    env = {k: v for k, v in parsing.env().items() if k.startswith("KVPLAN_")}
    overrides = (document or compose())["services"]["planner"].get("environment", {})
    assert isinstance(overrides, dict), "use the mapping form for environment"
    for key, value in overrides.items():
        env[key] = compose_default(value)
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


def secret_mounts(document: dict[str, Any]) -> dict[str, str]:
    """The planner's secrets: path in the container -> the file compose mounts there
    (short form and a relative target mean /run/secrets/<name>)."""
    mounts = {}
    for entry in document["services"]["planner"].get("secrets", []):
        source = entry if isinstance(entry, str) else entry["source"]
        target = source if isinstance(entry, str) else entry.get("target", source)
        path = target if target.startswith("/") else f"/run/secrets/{target}"
        definition = document.get("secrets", {}).get(source, {})
        mounts[path] = compose_default(definition.get("file", f"(no file for {source!r})"))
    return mounts


def token_file_errors(document: dict[str, Any]) -> list[str]:
    """Why the planner of `document` could not read its token file, if it could not."""
    token_file = parse_settings([], environ=container_env(document)).token_file
    if not token_file:
        return ["KVPLAN_TOKEN_FILE is empty"]
    mounts = secret_mounts(document)
    if token_file not in mounts:
        return [f"KVPLAN_TOKEN_FILE={token_file} but the secrets mount {sorted(mounts)}"]
    return []


def test_the_compose_file_alone_needs_no_token_file() -> None:
    """A trial: compose starts no service whose file secret is missing, so the base
    file mounts none, and its planner (no credentials) stays on loopback."""
    document = compose()
    assert "secrets" not in document
    assert "secrets" not in document["services"]["planner"]
    settings = parse_settings([], environ=container_env())
    assert settings.token_file == ""
    assert bind_host(settings) == "127.0.0.1"


def test_tokens_overlay_is_valid_alone_and_merged() -> None:
    for document in (compose(COMPOSE_TOKENS_FILE), with_tokens()):
        errors = schema_errors(document)
        assert errors == [], "\n".join(errors)


def test_tokens_overlay_mounts_the_secret_where_kvplan_token_file_points() -> None:
    document = with_tokens()
    assert token_file_errors(document) == []
    settings = parse_settings([], environ=container_env(document))
    assert settings.token_file == "/run/secrets/kvplan-tokens"  # the path the docs name
    assert secret_mounts(document) == {settings.token_file: "./deploy/kvplan-tokens"}
    assert bind_host(settings) == "0.0.0.0"  # "auto": callers must authenticate
    # The rest of the planner is the base file's.
    base = compose()["services"]["planner"]
    planner = document["services"]["planner"]
    assert {k: v for k, v in planner.items() if k not in ("environment", "secrets")} == {
        k: v for k, v in base.items() if k != "environment"
    }


@pytest.mark.parametrize("breakage", ["other target", "no secret", "no token file"])
def test_token_file_check_finds_a_missing_mount(breakage: str) -> None:
    """A negative control: the check above can fail."""
    document = copy.deepcopy(with_tokens())
    planner = document["services"]["planner"]
    if breakage == "other target":
        planner["secrets"][0]["target"] = "kvplan-token"
    elif breakage == "no secret":
        del planner["secrets"]
    else:
        planner["environment"]["KVPLAN_TOKEN_FILE"] = "${KVPLAN_TOKEN_FILE:-}"
    assert token_file_errors(document)


def test_the_default_token_file_stays_out_of_git_and_the_image() -> None:
    (source,) = secret_mounts(with_tokens()).values()
    relative = source.removeprefix("./")
    assert relative == "deploy/kvplan-tokens"
    assert parsing.is_ignored(relative, parsing.ignore_patterns(ROOT / ".gitignore"))
    assert parsing.is_ignored(relative, parsing.ignore_patterns())  # .dockerignore
    assert "${KVPLAN_TOKENS_SECRET_FILE:-" in COMPOSE_TOKENS_FILE.read_text()


def test_the_token_instructions_agree_with_the_files() -> None:
    """The commands in the compose files' comments and in the docs name the overlay,
    the secret's path in the container, and the image's USER as the file's owner."""
    command = "docker compose -f docker-compose.yml -f docker-compose.tokens.yml up"
    owner = f"sudo chown {parsing.last('USER').args} deploy/kvplan-tokens"
    (token_file,) = secret_mounts(with_tokens())
    comments = {
        path.name: "\n".join(
            line.strip() for line in path.read_text().splitlines() if line.strip().startswith("#")
        )
        for path in (COMPOSE_FILE, COMPOSE_TOKENS_FILE)
    }
    docs = {name: (ROOT / "docs" / name).read_text() for name in ("security.md", "deployment.md")}
    for name, text in {**comments, **docs}.items():
        assert command in text, name
        assert token_file in text, name
        for file in re.findall(r" -f ([\w./-]*\w)", text):
            assert (ROOT / file).is_file(), f"{name}: {file}"
    for name, text in {
        COMPOSE_TOKENS_FILE.name: comments[COMPOSE_TOKENS_FILE.name],
        **docs,
    }.items():
        assert owner in text, name
        assert "deploy/kvplan-tokens" in text and "KVPLAN_TOKENS_SECRET_FILE" in text, name
