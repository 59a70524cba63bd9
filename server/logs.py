"""Structured logs: an event in `message`, identifiers as fields.

JSON (python-json-logger) is one object per line: every field JSON-escaped, so
an engine id with a newline cannot forge a line. The text format writes
`key=value` pairs and quotes (JSON string escapes) any value with a space,
quote, `=` or a control character, for the same reason. Every record carries
the request id of the call it was logged in.
"""

from __future__ import annotations

import json
import logging
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
        return line


def json_formatter() -> logging.Formatter:
    return JsonFormatter(
        "{asctime}{levelname}{name}{message}",
        style="{",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        timestamp=False,
    )


def configure_logging(log_format: str, level: str) -> None:
    # Neither format writes the caller's source line, thread or process, so skip
    # collecting them for every record (the logging HOWTO's "Optimization"): about
    # a third of the cost of the "plan computed" line each plan writes.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger("kvplan")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
