"""Logging off the event loop: records cross to the log thread with their fields,
a full queue drops and counts instead of blocking, and what is queued is written."""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import sys
import textwrap

from kvplan.server.logs import OffLoopHandler, TextFormatter, json_formatter


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
