"""The fork server the vLLM-side tests run their scripts through (tests/vllm_zygote.py,
client in tests/vllm_envs.py): a script run by it gets what `python <args>` would have
given, and no run sees what an earlier one did.

The mechanics are checked with this project's own Python and a server that preloads
`json` only (it starts in well under a second); what vLLM's import leaves behind (a
module changed by one script, the threads numpy's OpenBLAS starts) with vLLM 0.33's
server, the one the 0.33 tests of this worker share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm_envs import Zygote, ZygoteError, run_in_vllm, run_vllm_python

PYTHON = Path(sys.executable)

# What an interpreter tells about how it was started, and stdin, env, cwd and exit code.
REPORT = """
import json, os, sys
print("first line")
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "name": __name__,
    "file": globals().get("__file__"), "main": sys.modules["__main__"].__dict__ is globals(),
    "stdin": sys.stdin.read(), "marker": os.environ.get("KVPLAN_MARKER"),
    "cwd": os.getcwd(),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("KVPLAN_EXIT", "0")))
"""

SCRIPT = (
    """
import sibling
from dataclasses import dataclass
@dataclass
class Point:  # a dataclass needs its module in sys.modules
    x: "int"
print(sibling.VALUE, Point(1))
"""
    + REPORT
)


@pytest.fixture
def server() -> Iterator[Zygote]:
    zygote = Zygote(PYTHON, dict(os.environ), preload=("json",))
    yield zygote
    zygote.stop()


def both(
    server: Zygote, args: list[str], stdin: str | None = None, **env: str
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    full_env = {**os.environ, **env}
    alone = subprocess.run(
        [str(PYTHON), *args], input=stdin, capture_output=True, text=True, env=full_env,
        timeout=60,
    )  # fmt: skip
    forked = server.run(args, stdin, full_env, timeout=60)
    return alone, forked


def same(alone: subprocess.CompletedProcess[str], forked: subprocess.CompletedProcess[str]) -> None:
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        alone.returncode,
        alone.stdout,
        alone.stderr,
    )


def test_a_command_string_runs_as_in_its_own_interpreter(
    server: Zygote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a run starts in this process's working directory
    alone, forked = both(
        server, ["-c", REPORT, "a", "b"], "payload\n", KVPLAN_MARKER="x", KVPLAN_EXIT="3"
    )
    same(alone, forked)
    assert forked.returncode == 3 and '"argv": ["-c", "a", "b"]' in forked.stdout
    assert '"path0": ""' in forked.stdout and '"stdin": "payload\\n"' in forked.stdout
    assert f'"cwd": "{tmp_path}"' in forked.stdout


def test_a_script_runs_as_in_its_own_interpreter(server: Zygote, tmp_path: Path) -> None:
    """sys.path[0] is the script's directory (its sibling module imports), __file__ is
    set, and the script is `__main__` in sys.modules."""
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    script = tmp_path / "side.py"
    script.write_text(SCRIPT)
    alone, forked = both(server, [str(script), "--flag"], None)
    same(alone, forked)
    assert forked.returncode == 0 and forked.stdout.startswith("7 Point(x=1)\n")
    assert f'"path0": "{tmp_path}"' in forked.stdout and '"main": true' in forked.stdout


@pytest.mark.parametrize(
    "code",
    [
        "raise ValueError('no')",
        "import sys; sys.exit('a message')",
        "import sys; sys.exit()",
        "import sys; sys.stdout.write('partial'); sys.exit(300)",
        "import atexit; atexit.register(print, 'at exit')",
        "import threading, time; threading.Thread(target=lambda: (time.sleep(0.2), "
        "print('joined'))).start()",
        "import os; os._exit(5)",
        "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    ],
)
def test_endings_are_the_interpreters(server: Zygote, code: str) -> None:
    """Exceptions (traceback from the script's frame), SystemExit's forms, atexit
    handlers and non-daemon threads at the end, a hard exit and a signal."""
    same(*both(server, ["-c", code]))


def test_no_run_sees_what_an_earlier_one_did(server: Zygote) -> None:
    changed = server.run(
        ["-c", "import json; json.kvplan_mark = 1; print(hasattr(json, 'kvplan_mark'))"],
        None, dict(os.environ), timeout=60,
    )  # fmt: skip
    assert changed.stdout == "True\n"
    fresh = server.run(
        ["-c", "import json; print(hasattr(json, 'kvplan_mark'))"], None, dict(os.environ), 60
    )
    assert fresh.stdout == "False\n"


def test_a_timeout_kills_the_run_and_what_it_started(server: Zygote, tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
        "time.sleep(60)"
    )
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        server.run(["-c", code], None, dict(os.environ), timeout=3)
    assert stopped.value.output == "started\n"
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)
    # The server goes on serving.
    assert server.run(["-c", "print(1)"], None, dict(os.environ), 60).stdout == "1\n"


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return status != "Z"


def test_a_dead_server_is_restarted_once_then_fails_with_its_log(server: Zygote) -> None:
    env = dict(os.environ)
    assert server.run(["-c", "print(1)"], None, env, 60).stdout == "1\n"
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    assert server.run(["-c", "print(2)"], None, env, 60).stdout == "2\n"  # restarted
    # Dies during a run: that run fails with the server's exit, the next one restarts
    # it no more.
    killer = "import os, signal; os.kill(os.getppid(), signal.SIGKILL); import time; time.sleep(5)"
    with pytest.raises(ZygoteError, match="died"):
        server.run(["-c", killer], None, env, 60)
    with pytest.raises(ZygoteError, match="died twice"):
        server.run(["-c", "print(3)"], None, env, 60)


def test_a_server_that_cannot_import_says_why() -> None:
    broken = Zygote(PYTHON, dict(os.environ), preload=("no_such_module_here",))
    with pytest.raises(ZygoteError, match="No module named 'no_such_module_here'"):
        broken.run(["-c", "print(1)"], None, dict(os.environ), 60)
    broken.stop()


VLLM_STATE = """
import json
import numpy, torch, vllm.envs
first = not hasattr(vllm, "kvplan_mark")
vllm.kvplan_mark = True
torch.set_num_threads(1)
a = numpy.ones((200, 200))
print(json.dumps({"first": first, "cache_root": vllm.envs.VLLM_CACHE_ROOT,
                  "sum": float((a @ a).sum())}))
"""


def test_vllm_runs_start_from_the_imported_state_each(tmp_path: Path) -> None:
    """Through vLLM 0.33's server: a module one run changed is unchanged in the next;
    VLLM_CACHE_ROOT (a variable vLLM reads late) is each run's own; numpy's BLAS
    threads, stopped for the fork, serve the child."""
    answers = [
        run_in_vllm("0.33", ["-c", VLLM_STATE], env={"VLLM_CACHE_ROOT": str(tmp_path / str(n))})
        for n in range(2)
    ]
    for n, answer in enumerate(answers):
        assert answer["first"] is True
        assert answer["cache_root"] == str(tmp_path / str(n))
        assert answer["sum"] == 200.0**3
    plain = run_vllm_python("0.33", ["-c", "print(1)"], None, env=dict(os.environ), timeout=60)
    assert (plain.returncode, plain.stdout) == (0, "1\n")
