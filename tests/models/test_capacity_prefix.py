"""`kvplan capacity`'s minimum cacheable prefix column: the plan's
PrefixCacheDiagnostics.min_shared_prefix_tokens for every row, and
min_any_hit_prefix_tokens in brackets where lower."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplan.cli import main

MODELS = Path(__file__).parents[2] / "examples" / "models"


def test_capacity_shows_the_minimum_cacheable_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["capacity", "--model", str(MODELS / "qwen3-next-80b-a3b"), "--gpu", "H200"]
    base += ["--tp", "2,4", "--max-model-len", "32k"]
    assert main([*base, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["status"] for row in rows] == ["ok", "ok"]
    # A hybrid Mamba model: the attention block holds a Mamba state, so the minimum is
    # hundreds of tokens; more TP shards split the state and lower it.
    minimums = [row["min_cached_prefix"] for row in rows]
    assert minimums[0] > minimums[1] >= 256, minimums
    # A shared prefix of a longer stored prompt hits a token lower: the Mamba state
    # a prompt keeps is a unit below its last token.
    lower = [row["min_any_hit_prefix"] for row in rows]
    assert lower == [m - 1 for m in minimums], (lower, minimums)
    assert main(base) == 0
    table = capsys.readouterr().out
    assert "min cached prefix" in table and f"{minimums[0]:,} ({lower[0]:,})" in table
    assert "in brackets, where lower, a shared prefix of a longer stored prompt" in table
