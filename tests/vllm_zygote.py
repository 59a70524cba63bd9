"""A fork server for one vLLM release's CPU Python (tests/vllm_envs.py starts it).

Every vLLM-side script of the tests spends 10-20 s importing torch and vLLM before a
second of work. This process, started with that release's Python, imports them once
(PRELOAD), then forks a child for each script it is asked to run: the child is a fresh
copy of the imported state, so nothing one script does reaches the next.

It runs with the vLLM venv's Python only: no kvplan or pytest import here.

Protocol on the pipes the client holds (one JSON object a line): this process sends
{"ready": true, ...} once PRELOAD is imported (or {"ready": false, "error": ...}); then
for each request {"argv": [...], "env": {...}, "cwd": ..., "stdin": path|null,
"stdout": path, "stderr": path} it sends {"pid": child} and, when the child has ended,
{"pid": child, "returncode": code} (minus the signal number for a killed child, as
subprocess does). EOF on its input ends it.

What the child does is what `python <argv>` does after its imports: sys.argv and
sys.path[0] as the interpreter sets them for `-c` and for a script path, os.environ
replaced by the request's, the working directory, stdin / stdout / stderr opened on
the given files at the descriptor level (so handlers vLLM bound to sys.stdout during
the preload write to the child's file), the code run as `__main__`, SystemExit and
uncaught exceptions turned into the exit code and traceback the interpreter would
give, then non-daemon threads joined and atexit handlers run.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
import types
from typing import Any

# torch and the vLLM modules every side script imports (in the order conformance/
# vllm_driver.py imports them: vllm.config before the attention registry, whose
# import is otherwise circular). Model classes stay with the scripts that need them.
PRELOAD = (
    "torch",
    "vllm",
    "vllm.config",
    "vllm.logger",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.attention.backends.registry",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.engine.arg_utils",
    "vllm.distributed",
    "vllm.model_executor.layers.mamba.mamba_utils",
    "vllm.model_executor.model_loader.utils",
    "vllm.model_executor.models.registry",
)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this process when the one that started it ends (Linux prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _os_threads() -> int:
    """Threads of this process as the kernel counts them (native pools included)."""
    return len(os.listdir("/proc/self/task"))


def _run_as_main(argv: list[str]) -> int:
    """`python *argv` from here on: the exit code the interpreter would return."""
    if argv[0] == "-c":
        code, filename, path0 = argv[1], "<string>", ""
        sys.argv = ["-c", *argv[2:]]
    else:
        script = os.path.abspath(argv[0])
        with open(script, "rb") as file:
            code_bytes = file.read()
        # sys.path[0]: the directory of the script's real path, as the interpreter sets it
        code, filename = code_bytes.decode(), script
        path0 = os.path.dirname(os.path.realpath(script))
        sys.argv = list(argv)
    sys.path.insert(0, path0)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if filename != "<string>":
        main.__dict__["__file__"] = filename
    sys.modules["__main__"] = main
    try:
        exec(compile(code, filename, "exec"), main.__dict__)
        return 0
    except SystemExit as stop:
        if stop.code is None:
            return 0
        if isinstance(stop.code, int):
            return stop.code
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException as error:
        # The traceback starts at the script's frame, as the interpreter prints it.
        tb = error.__traceback__.tb_next if error.__traceback__ else None
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        return 1


def _child(request: dict[str, Any], control: tuple[int, int]) -> None:
    """The forked child: becomes `python *argv` and never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills what it started too
        _die_with_parent()
        for fd in control:
            os.close(fd)
        stdin = request["stdin"] or os.devnull
        for target, path, flags in (
            (0, stdin, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            fd = os.open(path, flags, 0o600)
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = _run_as_main(request["argv"])
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)


def main() -> None:
    _die_with_parent()
    # The control pipes are private descriptors: whatever the preload or a child
    # writes to stdout (vLLM logs there by default) cannot reach the protocol.
    reader = os.fdopen(os.dup(0), "r")
    writer = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # stdout to this process's log (the client's stderr file)
    control = (reader.fileno(), writer.fileno())
    # `python this_file` put tests/ first on sys.path: a child puts its own there.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]

    def send(message: dict[str, Any]) -> None:
        writer.write(json.dumps(message) + "\n")
        writer.flush()

    started = time.monotonic()
    try:
        for name in sys.argv[1:] or PRELOAD:  # tests/test_vllm_forkserver.py names its own
            importlib.import_module(name)
    except BaseException:
        send({"ready": False, "error": traceback.format_exc()})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # numpy's OpenBLAS starts its worker threads at import (one per extra core); its
    # fork handler stops them and they come back at the next BLAS call, in a child as
    # in a fresh interpreter. So count the threads left after one fork: any still
    # there would be copied into no child while a lock it held stayed held.
    probe = os.fork()
    if probe == 0:
        os._exit(0)
    os.waitpid(probe, 0)
    threads = _os_threads()
    if threads != 1:
        send({"ready": False, "error": f"{threads} threads outlive a fork; forking is unsafe"})
        return
    send({"ready": True, "pid": os.getpid(), "import_s": time.monotonic() - started})
    for line in reader:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, control)
        send({"pid": pid})
        _, status = os.waitpid(pid, 0)
        send({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
