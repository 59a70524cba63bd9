"""Every package that `make install` or the image installs is pinned in constraints.txt.

pip installs a package that the constraints do not name at whatever version PyPI has
that day, so a gap there is an unpinned dependency. The closure of each install is
walked over the requirement metadata of the packages in this venv, with the markers
evaluated for each Python the installs run on: redis needs async-timeout only before
Python 3.11.3, so on Debian bookworm's 3.11.2 (the base of `make image`) and not on
the pinned python:3.11-slim-bookworm (3.11.16) or on this venv's Python. A package
needed elsewhere but absent from this venv has no metadata here: it is checked by
name and version, and its own requirements are not followed (async-timeout 5.0.1
has none).
"""

from __future__ import annotations

import importlib.metadata
import platform
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.parsing import ROOT

CONSTRAINTS = ROOT / "constraints.txt"

# The Pythons the installs run on: the image's pinned base (Dockerfile, ARG
# PYTHON_IMAGE: python:3.11-slim-bookworm at Python 3.11.16), Debian bookworm's
# python3.11 (`make image`'s debootstrap base), and this venv's (`make install`).
PYTHONS = {
    "Python 3.11.16 (the image's base)": "3.11.16",
    "Python 3.11.2 (Debian bookworm: make image's base)": "3.11.2",
    f"Python {platform.python_version()} (this venv)": platform.python_version(),
}
MACHINES = ("x86_64", "aarch64")

# What each install asks for; `make install` is checked on each Python above too (a
# developer's may be Debian's). The `torch` extra is left out: only GPU hosts install
# it (scripts/gpu-check), and torch's CUDA wheels pin their own dependencies.
INSTALLS = {
    "image": ("server",),
    "make install": ("server", "dev", "chart"),
}


@dataclass(frozen=True)
class Pin:
    version: str
    requirement: Requirement


def pins() -> dict[str, list[Pin]]:
    result: dict[str, list[Pin]] = {}
    for number, raw in enumerate(CONSTRAINTS.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        requirement = Requirement(line)
        specifiers = list(requirement.specifier)
        assert len(specifiers) == 1 and specifiers[0].operator == "==", (
            f"constraints.txt line {number}: {line!r} is not an exact pin (name==version)"
        )
        pin = Pin(specifiers[0].version, requirement)
        result.setdefault(canonicalize_name(requirement.name), []).append(pin)
    return result


def environment(python: str, machine: str) -> dict[str, str]:
    env = {key: str(value) for key, value in default_environment().items()}
    env.update(
        python_full_version=python,
        python_version=".".join(python.split(".")[:2]),
        platform_machine=machine,
        sys_platform="linux",
        platform_system="Linux",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def applies(requirement: Requirement, env: dict[str, str], extras: Iterable[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**env, "extra": e}) for e in ("", *extras))


def kvplan_requirements() -> list[Requirement]:
    """kvplan's own, from pyproject.toml (the source, not a possibly stale install)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    for extra, requirements in project["optional-dependencies"].items():
        for text in requirements:
            requirement = Requirement(text)
            marker = f'extra == "{extra}"'
            if requirement.marker is not None:
                marker = f"({requirement.marker}) and {marker}"
            found.append(Requirement(f"{requirement.name}{requirement.specifier}; {marker}"))
    return found


def installed_requirements(name: str) -> list[Requirement] | None:
    try:
        distribution = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return [Requirement(text) for text in distribution.requires or []]


@dataclass(frozen=True)
class Needed:
    requirement: Requirement  # as the package that pulls it states it
    pulled_by: str
    followed: bool  # False: not installed in this venv, its requirements unknown here


def closure(env: dict[str, str], extras: tuple[str, ...]) -> dict[str, Needed]:
    """Every package installing kvplan[extras] pulls in on `env`, and who pulls it."""
    needed: dict[str, Needed] = {}
    queue: list[tuple[Requirement, str, tuple[str, ...]]] = [
        (r, "kvplan", extras) for r in kvplan_requirements()
    ]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while queue:
        requirement, parent, parent_extras = queue.pop()
        if not applies(requirement, env, parent_extras):
            continue
        name = canonicalize_name(requirement.name)
        wanted = tuple(sorted(requirement.extras))
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        children = installed_requirements(requirement.name)
        needed.setdefault(name, Needed(requirement, parent, children is not None))
        for child in children or []:
            queue.append((child, requirement.name, wanted))
    return needed


def pin_problems(
    extras: tuple[str, ...], label: str, machine: str, constraints: dict[str, list[Pin]]
) -> list[str]:
    """What is wrong with the pins of kvplan[extras]'s closure on `label`'s Python."""
    env = environment(PYTHONS[label], machine)
    problems: list[str] = []
    for name, need in sorted(closure(env, extras).items()):
        where = f"{name} (pulled by {need.pulled_by} on {label}, {machine})"
        matching = [p for p in constraints.get(name, []) if applies(p.requirement, env, ())]
        if not matching:
            problems.append(f"{where}: not pinned in constraints.txt for this Python")
            continue
        if len(matching) > 1:
            problems.append(f"{where}: pinned {len(matching)} times")
        pinned = matching[0].version
        if not need.requirement.specifier.contains(pinned, prereleases=True):
            problems.append(f"{where}: pinned {pinned}, needs {need.requirement.specifier}")
    return problems


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("label", PYTHONS)
@pytest.mark.parametrize("install", INSTALLS)
def test_every_installed_package_is_pinned(install: str, label: str, machine: str) -> None:
    problems = pin_problems(INSTALLS[install], label, machine, pins())
    assert problems == [], "\n".join(problems)


def test_this_venv_holds_the_pinned_versions() -> None:
    """`make install` installed with these constraints; a difference means a stale lock."""
    env = environment(platform.python_version(), platform.machine())
    constraints = pins()
    stale = []
    for name, need in sorted(closure(env, INSTALLS["make install"]).items()):
        assert need.followed, f"{name}: needed by {need.pulled_by} but not in this venv"
        pinned = [p.version for p in constraints[name] if applies(p.requirement, env, ())]
        installed = importlib.metadata.version(need.requirement.name)
        if pinned != [installed]:
            stale.append(f"{name}: installed {installed}, constraints.txt {pinned}")
    assert stale == [], "run `make lock`?\n" + "\n".join(stale)


def test_the_walk_follows_markers() -> None:
    """The closure is real: redis pulls async-timeout on 3.11.2 and not on 3.11.16, and
    the chart extra's matplotlib brings its own dependencies into `make install`."""
    old = closure(environment("3.11.2", "x86_64"), INSTALLS["image"])
    new = closure(environment("3.11.16", "x86_64"), INSTALLS["image"])
    assert set(old) - set(new) == {"async-timeout"}
    assert old["async-timeout"].pulled_by == "redis"
    assert not old["async-timeout"].followed  # not in this venv (Python >= 3.11.3)
    assert "matplotlib" not in new
    full = closure(environment("3.11.16", "x86_64"), INSTALLS["make install"])
    assert {"matplotlib", "python-dateutil", "tzdata", "pytest", "kubernetes-validate"} <= set(full)
    assert "torch" not in full


def test_an_unpinned_dependency_is_reported() -> None:
    """The pin check means something: without async-timeout's pin, 3.11.2 fails and
    3.11.16 does not; a pin outside the requirement's range fails too."""
    constraints = pins()
    without = {k: v for k, v in constraints.items() if k != "async-timeout"}
    bookworm = "Python 3.11.2 (Debian bookworm: make image's base)"
    image = "Python 3.11.16 (the image's base)"
    assert pin_problems(INSTALLS["image"], bookworm, "x86_64", without) == [
        f"async-timeout (pulled by redis on {bookworm}, x86_64):"
        " not pinned in constraints.txt for this Python"
    ]
    assert pin_problems(INSTALLS["image"], image, "x86_64", without) == []
    too_old = {**constraints, "redis": [Pin("4.6.0", Requirement("redis==4.6.0"))]}
    assert pin_problems(INSTALLS["image"], image, "x86_64", too_old) == [
        f"redis (pulled by kvplan on {image}, x86_64): pinned 4.6.0, needs >=5"
    ]


def test_the_build_backend_is_pinned() -> None:
    """The image builds kvplan's wheel with the pinned backend (--no-build-isolation after
    installing it with the constraints), so the backend needs a pin that satisfies
    pyproject.toml's build-system requirement."""
    constraints = pins()
    build_system = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    for text in build_system["requires"]:
        requirement = Requirement(text)
        (pin,) = constraints[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(pin.version), (text, pin.version)
