"""Reading a Hugging Face `config.json`: from a file, a model directory, or a model id in
the local Hugging Face cache (offline; nothing is downloaded).

Every field is read through `HFConfig`, whose errors name the field path and what was
expected: a field the importer cannot interpret is an error, never a guess.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvplan.models.layers import Dtype


class ModelConfigError(ValueError):
    """A config that cannot be read or interpreted; `field` is the path, if any."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


_MISSING = object()
_DTYPES = {
    "bfloat16": Dtype.BFLOAT16,
    "float16": Dtype.FLOAT16,
    "half": Dtype.FLOAT16,
    "float32": Dtype.FLOAT32,
    "float": Dtype.FLOAT32,
}


class HFConfig:
    """A config mapping with typed, path-naming accessors."""

    def __init__(self, data: Mapping[str, Any], path: str = "", source: str = "") -> None:
        self.data = dict(data)
        self.path = path
        self.source = source
        self.defaulted: tuple[str, ...] = ()  # fields filled from family defaults

    def _where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise ModelConfigError("required field is missing", self._where(key))
            return default
        return value

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(f"expected an integer, got {value!r}", self._where(key))
        if value < minimum:
            raise ModelConfigError(f"must be >= {minimum}, got {value}", self._where(key))
        return value

    def opt_integer(self, key: str, *, minimum: int = 1) -> int | None:
        return self.integer(key, minimum=minimum) if self.has(key) else None

    def size_or_none(self, key: str) -> int | None:
        """A size where 0 (or null, or absent) means "none", as HF configs write a shared
        expert or a low-rank query the model does not have (Qwen3-MoE:
        `shared_expert_intermediate_size: 0`)."""
        return self.integer(key, 0, minimum=0) or None

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise ModelConfigError(f"expected true or false, got {value!r}", self._where(key))
        return value

    def text(self, key: str, default: Any = _MISSING) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise ModelConfigError(f"expected a string, got {value!r}", self._where(key))
        return value

    def items(self, key: str) -> list[Any] | None:
        if not self.has(key):
            return None
        value = self.data[key]
        if not isinstance(value, list):
            raise ModelConfigError(f"expected a list, got {value!r}", self._where(key))
        return value

    def sub(self, key: str) -> HFConfig | None:
        if not self.has(key):
            return None
        value = self.data[key]
        if not isinstance(value, Mapping):
            raise ModelConfigError(f"expected a mapping, got {value!r}", self._where(key))
        return HFConfig(value, self._where(key), self.source)

    def dtype(self) -> Dtype:
        """The weights' dtype (`torch_dtype`, or `dtype` in newer configs); bf16 if unset."""
        for key in ("torch_dtype", "dtype"):
            if self.has(key):
                name = self.text(key)
                try:
                    return _DTYPES[name.removeprefix("torch.")]
                except KeyError:
                    raise ModelConfigError(
                        f"unsupported model dtype {name!r}; expected one of {sorted(_DTYPES)}",
                        self._where(key),
                    ) from None
        return Dtype.BFLOAT16


def hf_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub"


def _from_cache(model_id: str, environ: Mapping[str, str] | None) -> Path | None:
    repo = hf_cache_dir(environ) / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip() / "config.json"
        if candidate.is_file():
            return candidate
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def resolve_config_path(source: str, environ: Mapping[str, str] | None = None) -> Path:
    """A config.json path for a file, a model directory or a cached model id."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        candidate = path / "config.json"
        if candidate.is_file():
            return candidate
        raise ModelConfigError(f"{source}: directory has no config.json")
    if source.count("/") == 1 and not source.startswith((".", "/")):
        cached = _from_cache(source, environ)
        if cached is not None:
            return cached
        raise ModelConfigError(
            f"{source}: not a file or directory, and not in the local Hugging Face cache "
            f"({hf_cache_dir(environ)}); kvplan never downloads: pass the config.json path"
        )
    raise ModelConfigError(f"{source}: no such file or directory")


def load_config(source: str, environ: Mapping[str, str] | None = None) -> HFConfig:
    path = resolve_config_path(source, environ)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ModelConfigError(f"{path}: cannot read: {error.strerror}") from error
    except json.JSONDecodeError as error:
        raise ModelConfigError(f"{path}: not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return HFConfig(data, source=str(path))
