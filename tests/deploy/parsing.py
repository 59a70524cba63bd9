"""Just enough of the Dockerfile and .dockerignore formats for the deployment tests."""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_TOKENS_FILE = ROOT / "docker-compose.tokens.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ENV, ...
    args: str  # the rest, continuation lines joined
    line: int  # 1-based line of the keyword


def instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    """The instructions in order; comments (also inside continuations) dropped."""
    result: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        keyword, _, args = " ".join(pending).partition(" ")
        result.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    assert not pending, f"{path}: dangling line continuation"
    return result


def global_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults ("" when none)."""
    result: dict[str, str] = {}
    for instruction in instructions(path):
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            name, _, default = instruction.args.partition("=")
            result[name.strip()] = default.strip().strip('"')
    return result


def syntax_directive(path: Path = DOCKERFILE) -> str | None:
    """The `# syntax=` parser directive (the BuildKit frontend image), if the file has one."""
    for raw in path.read_text().splitlines():
        match = re.match(r"#\s*(\w+)\s*=\s*(\S+)\s*$", raw)
        if not match:
            return None  # directives come first; the first other line ends them
        if match[1].lower() == "syntax":
            return match[2]
    return None


def stages(path: Path = DOCKERFILE) -> list[list[Instruction]]:
    """The instructions of each build stage, each list starting with its FROM."""
    result: list[list[Instruction]] = []
    for instruction in instructions(path):
        if instruction.keyword == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def last(keyword: str, path: Path = DOCKERFILE) -> Instruction:
    """The instruction in force in the final image (the last one of its kind)."""
    found = [i for i in stages(path)[-1] if i.keyword == keyword]
    assert found, f"{path}: no {keyword} in the final stage"
    return found[-1]


def exec_form(args: str) -> list[str]:
    """The JSON (exec) form of ENTRYPOINT / CMD: a list of strings, never a shell line."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(item, str) for item in value), args
    return [str(item) for item in value]


def entrypoint(path: Path = DOCKERFILE) -> list[str]:
    return exec_form(last("ENTRYPOINT", path).args)


def healthcheck(path: Path = DOCKERFILE) -> tuple[dict[str, str], list[str]]:
    """HEALTHCHECK's --options and its exec-form CMD."""
    options_text, separator, command = last("HEALTHCHECK", path).args.partition("CMD ")
    assert separator, "HEALTHCHECK must run a command (not NONE)"
    options: dict[str, str] = {}
    for option in options_text.split():
        name, _, value = option.removeprefix("--").partition("=")
        options[name] = value
    return options, exec_form(command.strip())


def env(path: Path = DOCKERFILE) -> dict[str, str]:
    """ENV of the final stage, in the key=value form, later values winning."""
    result: dict[str, str] = {}
    for instruction in stages(path)[-1]:
        if instruction.keyword != "ENV":
            continue
        for item in shlex.split(instruction.args):
            key, separator, value = item.partition("=")
            assert separator, f"line {instruction.line}: use ENV key=value"
            result[key] = value
    return result


def exposed_ports(path: Path = DOCKERFILE) -> set[int]:
    ports: set[int] = set()
    for instruction in stages(path)[-1]:
        if instruction.keyword == "EXPOSE":
            ports.update(int(port.split("/")[0]) for port in instruction.args.split())
    return ports


@dataclass(frozen=True)
class IgnorePattern:
    regex: re.Pattern[str]
    negated: bool
    pattern: str


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1])
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out))


def ignore_patterns(path: Path = DOCKERIGNORE) -> list[IgnorePattern]:
    """The .dockerignore rules: cleaned paths, Go-style globs plus `**`, `!` re-includes."""
    patterns: list[IgnorePattern] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        text = line.removeprefix("!").strip().strip("/")
        text = re.sub(r"^\./", "", text)
        patterns.append(IgnorePattern(_pattern_regex(text), negated, text))
    return patterns


def is_ignored(relative: str, patterns: list[IgnorePattern]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pattern in patterns:
        if any(pattern.regex.fullmatch(candidate) for candidate in candidates):
            ignored = not pattern.negated
    return ignored


def build_context(root: Path = ROOT) -> list[str]:
    """The files and symlinks (relative, POSIX) `docker build` would send from root."""
    patterns = ignore_patterns(root / ".dockerignore")
    reincluded = [p.pattern for p in patterns if p.negated]
    found: list[str] = []
    for top, dirnames, filenames in os.walk(root):
        directory = Path(top)
        relative_dir = directory.relative_to(root).as_posix()
        prefix = "" if relative_dir == "." else f"{relative_dir}/"
        kept = []
        for name in sorted(dirnames):
            relative = f"{prefix}{name}"
            if (directory / name).is_symlink():
                if not is_ignored(relative, patterns):
                    found.append(relative)  # sent as a link, not followed
                continue
            # An ignored directory is skipped unless a `!` pattern reaches inside it.
            if is_ignored(relative, patterns) and not any(
                r.startswith(f"{relative}/") for r in reincluded
            ):
                continue
            kept.append(name)
        dirnames[:] = kept
        found.extend(
            f"{prefix}{name}"
            for name in sorted(filenames)
            if not is_ignored(f"{prefix}{name}", patterns)
        )
    return sorted(found)
