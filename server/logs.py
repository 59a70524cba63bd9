"""Structured logs: an event in `message`, identifiers as fields.

JSON (python-json-logger) is one object per line: every field JSON-escaped, so
an engine id with a newline cannot forge a line. The text format writes
`key=value` pairs and quotes (JSON string escapes) any value with a space,
quote, `=` or a control character, for the same reason. Every record carries
the request id of the call it was logged in.

Records are formatted and written by a thread of their own (`LogWriter`), never
on the event loop: a log consumer that stops reading (a full pipe) cannot stall
the RPCs, as a blocking write on the loop did. The queue is bounded; when it is
full a record is dropped, counted, and the count reported in the next line that
gets through. Records still queued are written at exit, for at most
`EXIT_FLUSH_S`: a reader that stopped reading must not keep the process from
exiting, so the log thread writes to its own duplicate of the stderr descriptor
(a write blocked there holds no lock the interpreter's exit needs).
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import os
import queue
import re
import sys
import threading
import time
from collections import deque
from typing import Any, Protocol, TextIO

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

_STANDARD = frozenset(RESERVED_ATTRS) | {"taskName", "request_id"}
_PLAIN = re.compile(r"[A-Za-z0-9._:/,+@-]*")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (the current call's) to every record logged in a call."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            from kvplan.server.guard import current_request_id

            request_id = current_request_id()
            if request_id:
                record.request_id = request_id
        return True


def _quoted(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if _PLAIN.fullmatch(text) and text else json.dumps(text)


class TextFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER message key=value ...`, values escaped."""

    def format(self, record: logging.LogRecord) -> str:
        message = json.dumps(record.getMessage())[1:-1]  # control characters escaped
        fields = [
            f"{key}={_quoted(value)}"
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_")
        ]
        request_id = getattr(record, "request_id", "")
        if request_id:
            fields.insert(0, f"request_id={_quoted(request_id)}")
        line = f"{self.formatTime(record)} {record.levelname} {record.name} {message}"
        if fields:
            line += " " + " ".join(fields)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.exc_text:  # rendered before the record crossed threads
            line += "\n" + record.exc_text
        return line


def json_formatter() -> logging.Formatter:
    return JsonFormatter(
        "{asctime}{levelname}{name}{message}",
        style="{",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        timestamp=False,
    )


QUEUED_RECORDS = 10_000  # records waiting for the log thread, at most
EXIT_FLUSH_S = 5.0  # how long exit waits for the queued records to be written


class RecordQueue(Protocol):
    def put_nowait(self, record: logging.LogRecord) -> None:
        """Queue `record`, or raise queue.Full."""


class LogWriter:
    """The log thread: every `interval_s` it formats what was queued and writes it
    to `stream` in one write.

    Queuing takes no lock and wakes no thread. The standard QueueListener woke its
    thread for every record; per plan (one "plan computed" line) this measured the
    metrics and log line on the event loop 73 -> 35 µs and the log thread's CPU
    83 -> 10 µs. A line reaches the stream at most `interval_s` after it was logged.
    """

    def __init__(
        self,
        stream: TextIO,
        formatter: logging.Formatter,
        capacity: int = QUEUED_RECORDS,
        interval_s: float = 0.05,
        owns_stream: bool = False,
    ) -> None:
        self._stream = stream
        self._owns_stream = owns_stream  # closed when the thread ends
        self._formatter = formatter
        self._capacity = capacity
        self._interval_s = interval_s
        # deque's append and popleft are atomic: the loop appends, this thread pops.
        self._records: deque[logging.LogRecord] = deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvplan-log", daemon=True)

    def put_nowait(self, record: logging.LogRecord) -> None:
        if len(self._records) >= self._capacity:
            raise queue.Full
        self._records.append(record)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Write what is queued and end the thread; False if it is still writing
        after `timeout_s` (a stream nobody reads: the thread, a daemon, is left)."""
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        if self._owns_stream:
            self._stream.close()
        return True

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self._write_queued()
        self._write_queued()

    def _write_queued(self) -> None:
        lines: list[str] = []
        while self._records:
            record = self._records.popleft()
            try:
                lines.append(self._formatter.format(record) + "\n")
            except Exception:  # a record that cannot be formatted is skipped, as by logging
                logging.Handler().handleError(record)
            # Let a waiting event loop have the GIL between records: a batch of 30
            # (50 ms of plans) would otherwise hold it up for about 0.4 ms at once.
            time.sleep(0)
        if not lines:
            return
        try:
            self._stream.write("".join(lines))
            self._stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream: logs are lost, planning goes on


class OffLoopHandler(logging.Handler):
    """Hands records to the log thread. A full queue drops the record and counts
    it, so that logging never blocks the caller."""

    def __init__(self, records: RecordQueue) -> None:
        super().__init__()
        self._records = records
        self._dropped = 0  # guarded by the handler's lock, which handle() holds

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.enqueue(self.prepare(record))
        except Exception:
            self.handleError(record)

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # Unlike QueueHandler.prepare, the fields stay fields: only what cannot
        # cross threads (args, a live traceback) is rendered here.
        record.msg = record.getMessage()
        record.args = None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        if self._dropped:
            note = logging.LogRecord(
                record.name, logging.WARNING, "", 0, "log records dropped", None, None
            )
            note.__dict__.update(dropped=self._dropped, queued_at_most=QUEUED_RECORDS)
            if not self._put(note):
                self._dropped += 1  # still full: `record` is dropped too
                return
            self._dropped = 0
        if not self._put(record):
            self._dropped += 1

    def _put(self, record: logging.LogRecord) -> bool:
        try:
            self._records.put_nowait(record)
        except queue.Full:
            return False
        return True


_writer: LogWriter | None = None


def _stop_writer() -> None:
    global _writer
    if _writer is not None:
        _writer.stop(EXIT_FLUSH_S)  # writes what is still queued, if it can
        _writer = None


def _own_stderr() -> TextIO:
    """A stream of the log thread's own on stderr's descriptor. Through sys.stderr a
    write blocked on a full pipe would hold its buffer's lock, which the interpreter
    takes to flush sys.stderr at exit: the process could never end. sys.stderr itself
    where it has no descriptor (a test's capture)."""
    try:
        descriptor = os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return sys.stderr
    return open(descriptor, "w", encoding="utf-8", errors="backslashreplace", closefd=True)


atexit.register(_stop_writer)


def configure_logging(log_format: str, level: str) -> None:
    # Neither format writes the caller's source line, thread or process, so skip
    # collecting them for every record (the logging HOWTO's "Optimization"): about
    # a third of the cost of the "plan computed" line each plan writes.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    global _writer
    _stop_writer()
    stream = _own_stderr()
    formatter = json_formatter() if log_format == "json" else TextFormatter()
    _writer = LogWriter(stream, formatter, owns_stream=stream is not sys.stderr)
    _writer.start()
    handler = OffLoopHandler(_writer)
    # On the caller's side: the request id lives in the call's context.
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger("kvplan")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
