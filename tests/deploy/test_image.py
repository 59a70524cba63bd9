"""The image itself: built from this tree with podman, then run and inspected.

The module's fixture builds the Dockerfile with scripts/build-image (podman or buildah
on the Debian bookworm base it makes once with debootstrap; cached layers reused), under
a tag of this run's own, so its time shows in --durations as the setup of the first
test. Then the image runs the way clusters run it: read-only root filesystem, as the
image's own USER, the state directory a volume. Nothing here skips: without podman,
root or a host that can start containers, the tests fail and say why.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy import parsing
from tests.deploy.parsing import ROOT
from tests.deploy.tools import offline_plan

BUILD_SCRIPT = ROOT / "scripts" / "build-image"
EXAMPLE = ROOT / "examples" / "llama-3.1-8b.yaml"
# The first build makes the debootstrap base (about 2 min on 2 cores) and installs the
# dependencies from PyPI; later builds reuse both.
BUILD_TIMEOUT_S = 540
IMAGE_UID = 10001

# The first build includes the base and the dependencies (see BUILD_TIMEOUT_S).
pytestmark = pytest.mark.timeout(600)

# Run inside the container: what the process, the filesystem and the venv look like.
FACTS_SCRIPT = r"""
import hashlib, importlib.metadata, importlib.util, json, os, subprocess, sys
from pathlib import Path

status = dict(
    line.split(":", 1) for line in Path("/proc/1/status").read_text().splitlines() if ":" in line
)
root_options = next(
    line.split()[3].split(",")
    for line in Path("/proc/self/mounts").read_text().splitlines()
    if line.split()[1] == "/"
)
try:
    Path("/opt/kvplan/written-by-the-test").write_text("x")
    write_error = ""
except OSError as error:
    write_error = error.strerror or str(error)
package = Path(importlib.util.find_spec("kvplan").submodule_search_locations[0])
files = {
    path.relative_to(package).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
    for path in sorted(package.rglob("*"))
    if path.is_file() and "__pycache__" not in path.parts
}
freeze = subprocess.run(
    [sys.executable, "-m", "pip", "freeze", "--disable-pip-version-check"],
    capture_output=True, text=True, check=True,
).stdout.splitlines()
print(json.dumps({
    "uid": status["Uid"].split(), "gid": status["Gid"].split(), "comm": status["Name"].strip(),
    "euid": os.geteuid(), "root_options": root_options, "write_error": write_error,
    "state_files": sorted(os.listdir(os.environ["KVPLAN_STATE_DIR"])),
    "version": importlib.metadata.version("kvplan"), "python": sys.version.split()[0],
    "files": files, "freeze": freeze,
}))
"""


def run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def podman() -> str:
    binary = shutil.which("podman")
    if binary is None:
        pytest.fail(
            "podman is not installed: run scripts/run-tests (it installs Debian's podman, "
            "buildah, debootstrap and runc), or apt-get install -y --no-install-recommends "
            "podman buildah debootstrap runc"
        )
    if os.geteuid() != 0:
        pytest.fail(
            "the image is built and run with rootful podman (scripts/build-image: "
            "debootstrap and the container storage need root): run the tests as root"
        )
    return binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The image of this tree, tagged for this run only (other runs share the storage
    and the tags localhost/kvplan:0.1.0 and the base's); untagged afterwards, so its
    layers stay as cache for the next build."""
    binary = podman()
    tag = f"localhost/kvplan-test:{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    built = run(["bash", str(BUILD_SCRIPT), "--no-run", tag], timeout=BUILD_TIMEOUT_S)
    if built.returncode != 0:
        pytest.fail(
            f"scripts/build-image --no-run {tag} failed ({built.returncode}):\n"
            f"{built.stderr[-4000:]}\n{built.stdout[-4000:]}"
        )
    print(f"image built in {time.monotonic() - started:.1f}s: {tag}")
    try:
        yield tag
    finally:
        run([binary, "untag", tag, tag], timeout=60)


@dataclass(frozen=True)
class Container:
    name: str
    port: int
    metrics_port: int

    def exec(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run([podman(), "exec", self.name, *command], timeout=timeout)


def podman_run() -> list[str]:
    """`podman run`, with runc where installed: crun refuses hosts with cgroup v1 and v2
    mounted together ("hybrid"), as this sandbox has. Limits no higher than this
    process's: podman's defaults exceed what such a sandbox lets a container raise."""
    runtime = ["--runtime", "runc"] if shutil.which("runc") else []
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]
    return [podman(), *runtime, "run", *limits]


def start(image: str, state: Path, *, remove: bool = True) -> Container:
    """The image started as a cluster runs it: read-only root, the image's own USER (no
    --user), the state directory a volume owned by that user, /tmp a tmpfs; no
    HEALTHCHECK timer (podman runs those through systemd, absent here)."""
    os.chown(state, IMAGE_UID, IMAGE_UID)
    box = Container(f"kvplan-image-test-{uuid.uuid4().hex[:12]}", free_port(), free_port())
    started = run(
        [*podman_run(), "-d", *(["--rm"] if remove else []), "--name", box.name,
         "--network", "host", "--read-only", "--no-healthcheck",
         "-v", f"{state}:/var/lib/kvplan", "--tmpfs", "/tmp:rw,mode=1777",
         "-e", f"KVPLAN_PORT={box.port}", "-e", f"KVPLAN_METRICS_PORT={box.metrics_port}",
         "-e", "KVPLAN_DEVICES=1xH100-80GB", image],
        timeout=120,
    )  # fmt: skip
    if started.returncode != 0:
        pytest.fail(f"this host could not start the image {image}:\n{started.stderr}")
    return box


@pytest.fixture(scope="module")
def container(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    box = start(image, tmp_path_factory.mktemp("image-state"))
    try:
        yield box
    finally:
        run([podman(), "rm", "-f", "-t", "0", box.name], timeout=60)


def kvplan_on_host() -> str:
    return str(Path(sys.executable).parent / "kvplan")


def wait_serving(box: Container) -> subprocess.CompletedProcess[str]:
    target = f"127.0.0.1:{box.port}"
    deadline = time.monotonic() + 30
    while True:
        probe = run([kvplan_on_host(), "health", "--target", target, "--timeout", "1"], 30)
        if probe.returncode == 0 or time.monotonic() > deadline:
            return probe
        time.sleep(0.2)


@pytest.fixture(scope="module")
def facts(container: Container) -> dict[str, Any]:
    """What the running container reports about itself, once it serves."""
    probe = wait_serving(container)
    logs = run([podman(), "logs", container.name], timeout=30)
    assert probe.returncode == 0, f"never SERVING: {probe.stderr}\n{logs.stderr}{logs.stdout}"
    done = container.exec("python", "-c", FACTS_SCRIPT)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_serves_and_answers_health_from_both_sides(container: Container) -> None:
    target = f"127.0.0.1:{container.port}"
    probe = wait_serving(container)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout == f"{target} (server): SERVING\n"
    # The image's own HEALTHCHECK command, as written, inside the container: it finds
    # the port from KVPLAN_PORT.
    _, health_command = parsing.healthcheck()
    healthy = container.exec(*health_command)
    assert healthy.returncode == 0, healthy.stderr
    assert healthy.stdout.strip() == f"{target} (server): SERVING"
    # A real plan through the container equals what this tree computes offline.
    planned = run([kvplan_on_host(), "plan", str(EXAMPLE), "--target", target, "--json"], 60)
    assert planned.returncode == 0, planned.stderr
    assert int(json.loads(planned.stdout)["num_blocks"]) == int(offline_plan(EXAMPLE)["num_blocks"])


def test_runs_as_the_images_non_root_user(facts: dict[str, Any], image: str) -> None:
    user = parsing.last("USER").args
    assert user == f"{IMAGE_UID}:{IMAGE_UID}"
    configured = run([podman(), "image", "inspect", "--format", "{{.Config.User}}", image], 60)
    assert configured.stdout.strip() == user
    # PID 1 is the server itself (ENTRYPOINT kvplan serve), every uid and gid the image's.
    assert facts["comm"] == "kvplan"
    assert facts["uid"] == [str(IMAGE_UID)] * 4
    assert facts["gid"] == [str(IMAGE_UID)] * 4
    assert facts["euid"] == IMAGE_UID


def test_root_filesystem_is_read_only_and_the_store_writes_its_volume(
    facts: dict[str, Any],
) -> None:
    assert "ro" in facts["root_options"], facts["root_options"]
    assert facts["write_error"] == "Read-only file system"
    # The embedded SQLite store (WAL) lives on the state volume, the one writable place.
    assert "kvplan.sqlite3" in facts["state_files"], facts["state_files"]


def tree_package_files() -> dict[str, str]:
    """The package as the wheel takes it from this tree (kvplan/server and kvplan/client
    are symlinks into server/ and client/), each file's sha256."""
    package = ROOT / "kvplan"
    files: dict[str, str] = {}
    for directory, subdirectories, names in os.walk(package, followlinks=True):
        subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
        for name in names:
            if name.endswith((".pyc", ".pyo")):
                continue
            path = Path(directory) / name
            relative = path.relative_to(package).as_posix()
            files[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def package_differences(tree: dict[str, str], image: dict[str, str]) -> list[str]:
    """Files the image has and the tree lacks, modules the image lacks, and files whose
    bytes differ (a stale cached layer, an older wheel)."""
    extra = [f"only in the image: {p}" for p in sorted(set(image) - set(tree))]
    missing = [
        f"not in the image: {p}" for p in sorted(set(tree) - set(image)) if p.endswith(".py")
    ]
    stale = [f"differs: {p}" for p in sorted(set(image) & set(tree)) if image[p] != tree[p]]
    return [*extra, *missing, *stale]


def test_installed_kvplan_is_this_tree(facts: dict[str, Any]) -> None:
    """Every module of the tree is in the image with the same bytes, and the image has
    nothing the tree lacks."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert facts["version"] == version
    image_files: dict[str, str] = facts["files"]
    assert package_differences(tree_package_files(), image_files) == []
    assert len([p for p in image_files if p.endswith(".py")]) > 50


def test_the_tree_comparison_finds_a_stale_image() -> None:
    """The clean result above means something: an image one module behind, with a
    module the tree dropped and without one it added, fails."""
    tree = tree_package_files()
    image = dict(tree)
    image["cli.py"] = hashlib.sha256(b"an older cli.py").hexdigest()
    image["removed_since.py"] = image.pop("fieldcheck.py")
    assert package_differences(tree, image) == [
        "only in the image: removed_since.py",
        "not in the image: fieldcheck.py",
        "differs: cli.py",
    ]


def test_pip_freeze_is_the_pinned_set(facts: dict[str, Any]) -> None:
    """Every distribution in the image's venv at its constraints.txt version, and
    kvplan's server requirements all there (pip, setuptools: the venv's own)."""
    pinned: dict[str, set[str]] = {}
    for raw in (ROOT / "constraints.txt").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            requirement = Requirement(line)
            pinned.setdefault(canonicalize_name(requirement.name), set()).update(
                spec.version for spec in requirement.specifier
            )
    installed: dict[str, str] = {}
    for line in facts["freeze"]:
        name, separator, version = line.partition("==")
        if not separator:
            assert line.startswith("kvplan @ file:///wheels/kvplan-"), line
            continue
        installed[canonicalize_name(name)] = version
    unpinned = {n: v for n, v in installed.items() if v not in pinned.get(n, set())}
    assert unpinned == {}, {n: (v, sorted(pinned.get(n, set()))) for n, v in unpinned.items()}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["server"]]
    assert {canonicalize_name(Requirement(r).name) for r in wanted} <= set(installed)
    assert not [n for n in installed if n.startswith(("torch", "triton", "nvidia-cu"))]


def test_sigterm_drains_and_exits_0(image: str, tmp_path: Path) -> None:
    """`podman stop` sends the image's STOPSIGNAL (SIGTERM): the server drains and exits
    0 well inside compose's 15 s stop_grace_period."""
    box = start(image, tmp_path, remove=False)
    try:
        assert wait_serving(box).returncode == 0
        stopping = time.monotonic()
        stopped = run([podman(), "stop", "-t", "15", box.name], timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert time.monotonic() - stopping < 10
        code = run([podman(), "inspect", "--format", "{{.State.ExitCode}}", box.name], 60)
        logs = run([podman(), "logs", box.name], timeout=30)
        assert code.stdout.strip() == "0", logs.stdout + logs.stderr
        # KVPLAN_LOG_FORMAT=json: every line the server wrote is a JSON object.
        lines = [line for line in (logs.stdout + logs.stderr).splitlines() if line.strip()]
        assert lines and all(json.loads(line)["message"] for line in lines)
    finally:
        run([podman(), "rm", "-f", "-t", "0", box.name], timeout=60)
