"""The attention block sizes vLLM can run (`--block-size`), per platform.

vLLM 0.32-0.34's CacheConfig takes any `block_size` >= 1. The size is checked when the
model's attention layers choose their backend: a size the user gave is passed to the
selector, and a backend takes it only as a multiple of one of its kernel block sizes
(`AttentionBackend.supports_block_size`). When no candidate backend of the platform
takes it, the engine stops while building the model ("No valid attention backend
found for cuda ... Reasons: {FLASH_ATTN: [block_size not supported], ...}").

The candidates are each platform's `_get_backend_priorities` (vllm/platforms/cuda.py,
rocm.py). The table is the same in 0.32, 0.33 and 0.34;
tests/models/test_block_sizes_against_vllm.py derives it from each release's source.
A model with no attention layer (pure Mamba) picks no attention backend, so there the
size is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlatformBlocks:
    platform: str  # as vLLM names it in the error
    multiple_of: int  # a size runs when it is a multiple of this
    backends: str  # the candidates and the kernel sizes they take, for the message


# (platform, MLA model) -> the rule. ROCm's MLA candidates include ROCM_AITER_MLA,
# whose kernel takes any size (vLLM 0.32-0.34 use it when AITER's MLA is on).
BLOCK_SIZE_RULES: dict[tuple[str, bool], PlatformBlocks] = {
    ("cuda", False): PlatformBlocks(
        "cuda",
        16,
        "FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, TURBOQUANT: multiples of 16; "
        "FLASHINFER: 16, 32, 64",
    ),
    ("cuda", True): PlatformBlocks(
        "cuda",
        16,
        "TRITON_MLA, FLASH_ATTN_MLA: multiples of 16; FLASHINFER_MLA: 32, 64; "
        "FLASHMLA: 64; CUTLASS_MLA: 128",
    ),
    ("rocm", False): PlatformBlocks(
        "rocm",
        16,
        "ROCM_ATTN, ROCM_AITER_UNIFIED_ATTN, TRITON_ATTN: multiples of 16; ROCM_AITER_FA: 16, 32",
    ),
    ("rocm", True): PlatformBlocks(
        "rocm", 1, "ROCM_AITER_MLA, ROCM_AITER_TRITON_MLA: any size; TRITON_MLA: multiples of 16"
    ),
}


def platform_of(gpu_arch: str) -> str:
    """vLLM's platform for a catalog GPU's architecture: ROCm for AMD's CDNA, else
    CUDA (a GPU given only by its size is taken as CUDA, as the estimates are)."""
    return "rocm" if gpu_arch == "cdna" else "cuda"


def block_size_problem(block_size: int, *, platform: str, mla: bool) -> str | None:
    """Why vLLM cannot run attention with this block size here (None: it can)."""
    rule = BLOCK_SIZE_RULES[(platform, mla)]
    if block_size >= 1 and block_size % rule.multiple_of == 0:
        return None
    examples = ", ".join(str(rule.multiple_of * n) for n in (1, 2, 3, 4))
    return (
        f"--block-size {block_size}: no attention backend vLLM 0.32-0.34 selects on "
        f"{rule.platform} for {'an MLA' if mla else 'this'} model takes it ({rule.backends}); "
        f'vLLM stops with "No valid attention backend found". Give a multiple of '
        f"{rule.multiple_of} ({examples}, ...) or leave it unset"
    )
