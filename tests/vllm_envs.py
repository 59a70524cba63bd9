"""The vLLM CPU environments the tests run vLLM's own code in (scripts/vllm-venv
builds them; `make test` does so first). A missing one fails the test, with how to
build it: these checks are never skipped.

`run_in_vllm` runs a script with a release's Python through a fork server
(tests/vllm_zygote.py): one long-lived process per release and import environment in
each pytest worker, started at its first use, that has imported torch and vLLM once and
forks a fresh child per script, so a script starts in well under a second instead of
importing for 10-20 s. KVPLAN_VLLM_FORKSERVER=0 gives each script a new interpreter
instead; both give the script the same argv, stdin, environment and working directory,
and the same exit code, stdout and stderr back (the two gave the same answer in every
vLLM-side test, compared with KVPLAN_VLLM_RECORD)."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import select
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

VLLM_CACHE = Path(os.environ.get("KVPLAN_VLLM_CACHE", Path.home() / ".cache" / "kvplan"))
ZYGOTE = Path(__file__).with_name("vllm_zygote.py")


def vllm_python(release: str) -> Path:
    """The Python of vLLM `release` ("0.33")'s CPU environment."""
    venv = VLLM_CACHE / f"vllm-{release}" / "venv"
    if not (venv / ".kvplan-vllm-ready").exists():
        pytest.fail(
            f"the vLLM {release} CPU venv is missing ({venv}); build it with "
            f"`scripts/vllm-venv {release}` (make test does)"
        )
    return venv / "bin" / "python"


STUBS = Path(__file__).parent / "models" / "vllm_stubs"


def forkserver_enabled() -> bool:
    return os.environ.get("KVPLAN_VLLM_FORKSERVER", "1") != "0"


def run_in_vllm(
    release: str,
    args: list[str],
    payload: object = None,
    *,
    cache_root: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 280,
) -> Any:
    """Run `args` (a script's path, or ["-c", code]) with vLLM `release`'s Python,
    `payload` as JSON on its stdin; its last stdout line, read as JSON.

    `cache_root`: a VLLM_CACHE_ROOT of the test's own (the releases would overwrite
    each other's model-info cache) and tests/models/vllm_stubs on the path (inert
    stand-ins for modules the CPU venvs lack and the model builds never use), and
    vLLM's logging left unconfigured (VLLM_CONFIGURE_LOGGING=0) unless `env` says.
    `env`: variables set on top of this process's environment, for the whole run
    (before the script's first line, as a variable the script reads at import)."""
    full_env = {**os.environ, **(env or {})}
    if cache_root is not None:
        path = os.pathsep.join(filter(None, [str(STUBS), full_env.get("PYTHONPATH")]))
        full_env["VLLM_CACHE_ROOT"] = str(cache_root / "vllm-cache")
        full_env["PYTHONPATH"] = path
        # The model-building side scripts turn vLLM's stdout logging off before they
        # import it (vllm_model_side.py and the scripts that import it); a variable
        # vLLM reads at import must hold from the interpreter's start, since a fork
        # server imports vLLM before the script runs.
        full_env.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    result = run_vllm_python(
        release,
        args,
        None if payload is None else json.dumps(payload),
        env=full_env,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = result.stdout.strip().splitlines()[-1]
    _record(release, args, answer)
    return json.loads(answer)


def _record(release: str, args: list[str], answer: str) -> None:
    """KVPLAN_VLLM_RECORD=<file>: append what each run answered, one JSON line (test,
    release, script, answer), to compare a run with the fork server against one without
    (the pytest temporary directory in an answer is written as <tmp>)."""
    path = os.environ.get("KVPLAN_VLLM_RECORD")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    code = args[1] if args[0] == "-c" else ""
    script = f"-c {hashlib.sha256(code.encode()).hexdigest()}" if code else Path(args[0]).name
    answer = re.sub(r"/tmp/pytest-of-[^/]+/pytest-\d+/", "<tmp>/", answer)
    line = json.dumps({"test": test, "release": release, "script": script, "answer": answer})
    with open(path, "a") as file:
        file.write(line + "\n")


def run_vllm_python(
    release: str,
    args: list[str],
    stdin: str | None,
    *,
    env: dict[str, str],
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([vllm_python(release), *args], input=stdin, env=env,
    capture_output=True, text=True, timeout=timeout)`, through the release's fork server
    unless KVPLAN_VLLM_FORKSERVER=0."""
    python = vllm_python(release)
    if not forkserver_enabled():
        return subprocess.run(
            [str(python), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    return _zygote_for(python, env).run(args, stdin, env, timeout)


# Variables nothing reads while the preload imports: they may differ between the
# scripts one fork server runs (VLLM_CACHE_ROOT: vLLM reads it where it uses the
# cache; PYTEST_CURRENT_TEST: pytest changes it with every test). Every other variable
# is part of the environment the server imported vLLM under, so a script with another
# value gets a server of its own (PYTHONPATH with the stubs, VLLM_CONFIGURE_LOGGING=0).
LATE_READ_VARIABLES = frozenset({"VLLM_CACHE_ROOT", "PYTEST_CURRENT_TEST"})
# Servers one pytest process keeps (each holds about 250-400 MB of its own after the
# imports): the three releases with and without the stubs. Past that the one used
# longest ago is stopped.
MAX_ZYGOTES = 6
# How long a fork server may take to import torch and vLLM (about 12 s on a quiet
# machine, several times that on two busy cores).
START_TIMEOUT_S = 300.0

_ZYGOTES: dict[tuple[str, tuple[tuple[str, str], ...]], Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def _zygote_for(python: Path, env: dict[str, str]) -> Zygote:
    import_env = {k: v for k, v in env.items() if k not in LATE_READ_VARIABLES}
    key = (str(python), tuple(sorted(import_env.items())))
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.pop(key, None) or Zygote(python, import_env)
        _ZYGOTES[key] = zygote  # last in the dict: the most recently used
        while len(_ZYGOTES) > MAX_ZYGOTES:
            _ZYGOTES.pop(next(iter(_ZYGOTES))).stop()
        return zygote


@atexit.register
def _stop_zygotes() -> None:
    with _ZYGOTES_LOCK:
        for zygote in _ZYGOTES.values():
            zygote.close_input()  # all of them first: they exit side by side
        for zygote in _ZYGOTES.values():
            zygote.stop()
        _ZYGOTES.clear()


class ZygoteError(RuntimeError):
    """The fork server could not start or died; the message carries its log."""


class Zygote:
    """The client side of one tests/vllm_zygote.py process (started at first use)."""

    def __init__(
        self, python: Path, import_env: dict[str, str], preload: tuple[str, ...] = ()
    ) -> None:
        self.python = python
        self.import_env = import_env
        self.preload = preload  # modules instead of the server's PRELOAD (its own tests)
        self.process: subprocess.Popen[bytes] | None = None
        self.unread = b""  # what the server sent past the last whole line
        self.log: IO[bytes] | None = None
        self.deaths = 0  # one death restarts it; after a second every run fails
        self.pending = False  # a request sent and not yet answered
        self.child: int | None = None  # the child of the request under way
        self.lock = threading.Lock()

    def _log_tail(self) -> str:
        if self.log is None:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:].decode(errors="replace")

    def _start(self) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  # closed in stop()
        self.process = subprocess.Popen(
            [str(self.python), str(ZYGOTE), *self.preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=self.import_env,
        )
        self.unread = b""
        ready = self._read(START_TIMEOUT_S)
        if ready is None or not ready.get("ready"):
            error = "" if ready is None else str(ready.get("error"))
            self.stop()
            raise ZygoteError(f"the vLLM fork server did not start: {error}\n{self._log_tail()}")
        record = os.environ.get("KVPLAN_VLLM_RECORD")
        if record:
            started = {"server": str(self.python), "import_s": round(ready["import_s"], 1),
                       "PYTHONPATH": self.import_env.get("PYTHONPATH", "")}  # fmt: skip
            with open(record, "a") as file:
                file.write(json.dumps(started) + "\n")

    def close_input(self) -> None:
        """EOF on its input: the server ends (stop() waits for it)."""
        if self.process is not None and self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()

    def stop(self) -> None:
        self.close_input()
        process, self.process = self.process, None
        if process is None:
            return
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
        # self.log stays: a test that found the server dead reads its last words

    def _read(self, timeout: float) -> dict[str, Any] | None:
        """The server's next message; None at EOF (it died) or after `timeout` s."""
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        while b"\n" not in self.unread:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                return None
            data = os.read(fd, 1 << 16)
            if not data:
                return None
            self.unread += data
        line, self.unread = self.unread.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def _died(self) -> ZygoteError:
        assert self.process is not None
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        return ZygoteError(
            f"the vLLM fork server ({self.python}) died (exit {code}):\n{self._log_tail()}"
        )

    def run(
        self, args: list[str], stdin: str | None, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        with self.lock:
            if self.process is not None and self.process.poll() is not None:
                self.deaths += 1  # died between runs (the OOM killer, say)
                self.stop()
            if self.process is None:
                if self.deaths > 1:
                    raise ZygoteError(
                        f"the vLLM fork server ({self.python}) died twice; not restarted:\n"
                        f"{self._log_tail()}"
                    )
                try:
                    self._start()
                except ZygoteError:
                    self.deaths += 1
                    raise
            try:
                with tempfile.TemporaryDirectory(prefix="kvplan-vllm-run-") as scratch:
                    return self._run_in(Path(scratch), args, stdin, env, timeout)
            except ZygoteError:
                self.deaths += 1  # this test fails with its log; the next run restarts it
                self.stop()
                raise
            except BaseException:
                if self.pending:
                    # Cut short between request and answer (pytest-timeout's alarm, an
                    # interrupt): the server's next lines would answer this request, so
                    # it goes, with the child, and the next run starts a new one.
                    if self.child is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(self.child, signal.SIGKILL)
                    self.stop()
                raise
            finally:
                self.pending, self.child = False, None

    def _run_in(
        self,
        scratch: Path,
        args: list[str],
        stdin: str | None,
        env: dict[str, str],
        timeout: float,
    ) -> subprocess.CompletedProcess[str]:
        assert self.process is not None and self.process.stdin is not None
        stdin_path = None
        if stdin is not None:
            stdin_path = scratch / "stdin"
            stdin_path.write_text(stdin)
        out, err = scratch / "stdout", scratch / "stderr"
        request = {
            "argv": args,
            "env": env,
            "cwd": os.getcwd(),
            "stdin": None if stdin_path is None else str(stdin_path),
            "stdout": str(out),
            "stderr": str(err),
        }
        deadline = time.monotonic() + timeout
        self.pending = True
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        started = self._read(deadline - time.monotonic())
        if started is None:
            raise self._died()
        pid = self.child = int(started["pid"])
        ended = self._read(deadline - time.monotonic())
        timed_out = ended is None and self.process.poll() is None
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # the child leads a process group
            ended = self._read(30)
        if ended is None:
            raise self._died()
        self.pending = False  # answered: the server waits for the next request
        command = [str(self.python), *args]
        stdout = _read_text(out)
        stderr = _read_text(err)
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, int(ended["returncode"]), stdout, stderr)


def _read_text(path: Path) -> str:
    """A child's output as `subprocess.run(text=True)` gives it (universal newlines)."""
    if not path.exists():
        return ""
    with path.open(encoding=None, newline=None) as file:
        return file.read()
