"""Structured logs: an event in `message`, identifiers as fields.

JSON (python-json-logger) is one object per line: every field JSON-escaped, so
an engine id with a newline cannot forge a line. The text format writes
`key=value` pairs and quotes (JSON string escapes) any value with a space,
quote, `=` or a control character, for the same reason. Every record carries
the request id of the call it was logged in.

Records are formatted and written by a thread of their own (the standard
library's QueueHandler and QueueListener), never on the event loop: a log
consumer that stops reading (a full pipe) cannot stall the RPCs, as a blocking
write on the loop did. The queue is bounded; when it is full a record is
dropped, counted, and the count reported in the next line that gets through.
Records still queued are written at exit.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import re
import sys
from typing import Any

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


class OffLoopHandler(logging.handlers.QueueHandler):
    """Hands records to the log thread. A full queue drops the record and counts
    it, so that logging never blocks the caller."""

    def __init__(self, records: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(records)
        self._records = records
        self._dropped = 0  # guarded by the handler's lock, which handle() holds

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


_listener: logging.handlers.QueueListener | None = None


def _stop_listener() -> None:
    global _listener
    if _listener is not None:
        _listener.stop()  # writes what is still queued
        _listener = None


atexit.register(_stop_listener)


def configure_logging(log_format: str, level: str) -> None:
    # Neither format writes the caller's source line, thread or process, so skip
    # collecting them for every record (the logging HOWTO's "Optimization"): about
    # a third of the cost of the "plan computed" line each plan writes.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    global _listener
    writer = logging.StreamHandler(sys.stderr)
    writer.setFormatter(json_formatter() if log_format == "json" else TextFormatter())
    records: queue.Queue[logging.LogRecord] = queue.Queue(QUEUED_RECORDS)
    handler = OffLoopHandler(records)
    # On the caller's side: the request id lives in the call's context.
    handler.addFilter(RequestIdFilter())
    _stop_listener()
    _listener = logging.handlers.QueueListener(records, writer)
    _listener.start()
    root = logging.getLogger("kvplan")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
