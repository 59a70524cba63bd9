"""Storage dtypes and the engine's cache-dtype setting."""

from __future__ import annotations

from enum import Enum


class StorageDtype(Enum):
    """Element type of a cache tensor; the value is its size in bytes."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    UINT8 = "uint8"
    INT8 = "int8"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"

    @property
    def size_bytes(self) -> int:
        return _DTYPE_BYTES[self]


_DTYPE_BYTES = {
    StorageDtype.FLOAT32: 4,
    StorageDtype.FLOAT16: 2,
    StorageDtype.BFLOAT16: 2,
    StorageDtype.UINT8: 1,
    StorageDtype.INT8: 1,
    StorageDtype.FLOAT8_E4M3FN: 1,
    StorageDtype.FLOAT8_E5M2: 1,
}

# Cache-dtype settings that keep their own storage type; every other quantized
# format ("fp8*", "nvfp4*", "turboquant_*", ...) is stored as raw uint8.
_CACHE_DTYPE_STORAGE = {
    "float16": StorageDtype.FLOAT16,
    "bfloat16": StorageDtype.BFLOAT16,
    "float32": StorageDtype.FLOAT32,
    "int8_per_token_head": StorageDtype.INT8,
    "fp8_inc": StorageDtype.FLOAT8_E4M3FN,
}


def storage_dtype_for_cache_dtype(cache_dtype: str, model_dtype: StorageDtype) -> StorageDtype:
    """What a layer stores for the engine's `kv_cache_dtype` setting."""
    if cache_dtype == "auto":
        return model_dtype
    return _CACHE_DTYPE_STORAGE.get(cache_dtype, StorageDtype.UINT8)
