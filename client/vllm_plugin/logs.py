"""The plugin's log records: one logger, each message tagged with `LOG_TAG`.

vLLM's default log format prints the source file and line (`[hooks.py:454]`), not
the logger's name, so the name `vllm.plugins.kvplan` shows only under a format that
prints `%(name)s`. The tag at the start of every message is what operators grep
for under any format (docs/vllm.md, "Logs"). The caller's file and line are kept.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

LOGGER_NAME = "vllm.plugins.kvplan"
LOG_TAG = "[kvplan-plugin]"


class _Tagged(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return f"{LOG_TAG} {msg}", kwargs


log = _Tagged(logging.getLogger(LOGGER_NAME), {})
