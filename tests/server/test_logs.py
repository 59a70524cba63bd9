"""Logging off the event loop: records cross to the log thread with their fields,
a full queue drops and counts instead of blocking, and what is queued is written."""

from __future__ import annotations

import io
import json
import logging
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvplan.server.logs import LogWriter, OffLoopHandler, TextFormatter, json_formatter


def _record(message: str, **fields: object) -> logging.LogRecord:
    record = logging.LogRecord("kvplan.test", logging.INFO, __file__, 1, message, None, None)
    record.__dict__.update(fields)
    return record


def test_fields_and_traceback_cross_threads() -> None:
    records: queue.Queue[logging.LogRecord] = queue.Queue(4)
    handler = OffLoopHandler(records)
    try:
        raise ValueError("boom")
    except ValueError:
        failing = logging.LogRecord(
            "kvplan.test", logging.ERROR, __file__, 1, "failed %s", ("once",), sys.exc_info()
        )
    failing.__dict__["engine_id"] = "engine-a"
    handler.handle(failing)
    (queued,) = [records.get_nowait()]
    assert queued.exc_info is None and queued.args is None
    line = json.loads(json_formatter().format(queued))
    assert line["message"] == "failed once" and line["engine_id"] == "engine-a"
    assert "ValueError: boom" in line["exc_info"]
    text = TextFormatter().format(queued)
    assert text.splitlines()[0].endswith("failed once engine_id=engine-a")
    assert text.splitlines()[-1] == "ValueError: boom"


def test_a_full_queue_drops_and_counts() -> None:
    records: queue.Queue[logging.LogRecord] = queue.Queue(2)
    handler = OffLoopHandler(records)
    for index in range(5):
        handler.handle(_record(f"line {index}"))  # never blocks
    assert [records.get_nowait().getMessage() for _ in range(2)] == ["line 0", "line 1"]
    handler.handle(_record("line 5"))
    note, after = records.get_nowait(), records.get_nowait()
    assert (note.getMessage(), note.levelno, note.__dict__["dropped"]) == (
        "log records dropped",
        logging.WARNING,
        3,
    )
    assert after.getMessage() == "line 5" and records.empty()
    # Full again when the note is due: the count carries over, the record is counted.
    handler.handle(_record("a"))
    handler.handle(_record("b"))
    handler.handle(_record("c"))  # dropped: 1
    records.get_nowait()
    handler.handle(_record("d"))  # the note (1 dropped) fits; "d" does not: 1
    handler.handle(_record("e"))  # full: the note cannot go, "e" dropped: 2
    assert [records.get_nowait().getMessage() for _ in range(2)] == ["b", "log records dropped"]
    handler.handle(_record("f"))
    note = records.get_nowait()
    assert note.getMessage() == "log records dropped" and note.__dict__["dropped"] == 2
    assert records.get_nowait().getMessage() == "f"


def test_queued_records_are_written_at_exit() -> None:
    script = textwrap.dedent(
        """
        import logging
        from kvplan.server.logs import configure_logging
        configure_logging("json", "info")
        log = logging.getLogger("kvplan.server.test")
        for index in range(2000):
            log.info("line", extra={"index": index})
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [line["index"] for line in lines] == list(range(2000))


def test_the_log_thread_writes_in_batches_and_bounds_its_queue() -> None:
    stream = io.StringIO()
    writer = LogWriter(stream, TextFormatter(), capacity=3, interval_s=0.01)
    for message in ("a", "b", "c"):
        writer.put_nowait(_record(message))
    with pytest.raises(queue.Full):  # bounded: the handler drops and counts
        writer.put_nowait(_record("d"))
    writer.start()
    deadline = time.monotonic() + 10
    while stream.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [line.split(" ", 4)[-1] for line in stream.getvalue().splitlines()] == ["a", "b", "c"]
    writer.put_nowait(_record("e"))  # room again once written
    writer.stop()  # writes what is queued
    assert stream.getvalue().splitlines()[-1].endswith(" e")


def test_a_broken_stream_loses_lines_not_the_log_thread() -> None:
    class BreaksOnce(io.StringIO):
        broken = False

        def write(self, text: str) -> int:
            if not self.broken:
                self.broken = True
                raise BrokenPipeError("the log reader went away")
            return super().write(text)

    stream = BreaksOnce()
    writer = LogWriter(stream, TextFormatter(), interval_s=0.01)
    writer.put_nowait(_record("lost"))
    writer.start()
    deadline = time.monotonic() + 10
    while not stream.broken and time.monotonic() < deadline:
        time.sleep(0.01)
    writer.put_nowait(_record("written"))
    writer.stop()  # the thread survived the broken write and writes the next line
    assert stream.getvalue().splitlines()[-1].endswith(" written")
    assert "lost" not in stream.getvalue()


def test_stop_gives_up_on_a_write_that_never_returns() -> None:
    class Stuck(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.entered = threading.Event()
            self.release = threading.Event()

        def write(self, text: str) -> int:
            self.entered.set()
            self.release.wait(30)  # a full pipe nobody reads
            return super().write(text)

    stream = Stuck()
    writer = LogWriter(stream, TextFormatter(), interval_s=0.01)
    writer.put_nowait(_record("blocked"))
    writer.start()
    assert stream.entered.wait(10)
    started = time.monotonic()
    assert writer.stop(timeout_s=0.2) is False  # exit is not held up
    assert time.monotonic() - started < 5
    stream.release.set()
    assert writer.stop(timeout_s=10) is True  # the line goes out once the reader reads
    assert stream.getvalue().endswith(" blocked\n")
