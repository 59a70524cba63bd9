"""The request lengths and the prefill the prefix-cache probes use
(conformance/prefix_probe.py, conformance/scheduler_probe.py), apart from vLLM so
that the tests can compute kvplan's side of a probe without a release installed."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvplan.core.prefix_cache import PrefixCacheSetup, manager_view

_STORED_UNITS = 6  # the stored request spans this many scheduler blocks (+ a tail)
DEFAULT_CHUNKS = ("x0.5", "x1.37", "x3")


def probe_lengths(setup: PrefixCacheSetup, stored: int) -> list[int]:
    """Shared-prefix lengths around every unit the rules name."""
    units = {setup.scheduler_block, setup.hash_block}
    units |= {g.block_tokens for g in setup.groups}
    points = {1, stored - 1, stored}
    for unit in units:
        for k in (1, 2, 3, _STORED_UNITS - 1):
            for delta in (-1, 0, 1):
                points.add(k * unit + delta)
    return sorted(n for n in points if 0 < n <= stored)


def block_by_block(setup: PrefixCacheSetup) -> PrefixCacheSetup:
    """kvplan's prediction for a prompt prefilled as this probe prefills it (`_run`:
    a chunk ends at every scheduler block and at the scheduler's own stops), not in
    the engine's max_num_batched_tokens chunks: a Mamba state then exists at every
    block boundary. conformance/scheduler_probe.py checks the chunked prediction
    against the release's own scheduler. It is the KV cache manager's hit
    (`manager_view`): the bare manager this probe drives never replays a
    bounded-replay window, which only the scheduler does."""
    return replace(manager_view(setup), prefill_chunk_tokens=0)


def stored_and_tail(setup: PrefixCacheSetup) -> tuple[int, int]:
    """The stored request's length (_STORED_UNITS of the coarsest unit and half of
    one more, and a token: it ends inside a block) and the tokens a probe goes on
    with after its shared prefix (a unit and a token, so its lookup reaches past
    every unit boundary of the shared prefix)."""
    unit = max(setup.scheduler_block, *(g.block_tokens for g in setup.groups))
    return _STORED_UNITS * unit + unit // 2 + 1, unit + 1


@dataclass(frozen=True)
class ChunkSpec:
    """A chunk size: `tokens`, or `blocks` of the engine's coarsest block."""

    text: str
    tokens: int = 0
    blocks: float = 0.0

    def for_unit(self, unit: int) -> int:
        if self.tokens:
            return self.tokens
        return max(1, int(self.blocks * unit))


def parse_chunk(text: str) -> ChunkSpec:
    """`N` (tokens, N >= 1) or `xF` (F > 0 blocks); ValueError naming the spec."""
    try:
        if text.startswith("x"):
            blocks = float(text[1:])
            if blocks > 0:
                return ChunkSpec(text, blocks=blocks)
        else:
            tokens = int(text)
            if tokens >= 1:
                return ChunkSpec(text, tokens=tokens)
    except ValueError:
        pass
    raise ValueError(
        f"--chunk {text!r}: a chunk is a token count of 1 or more (100) or a positive "
        "multiple of the engine's coarsest block (x0.5, x1.37, x3)"
    )


__all__ = [
    "DEFAULT_CHUNKS",
    "ChunkSpec",
    "block_by_block",
    "parse_chunk",
    "probe_lengths",
    "stored_and_tail",
]
