"""docs/prefix-caching.md's worked-example tables are what
scripts/prefix-cache-examples prints today: the script plans each example engine
under every rule set, so a change to the planner or to the prefix-cache model that
moves a figure fails here until the doc is regenerated."""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "prefix-cache-examples"
REGENERATE = ".venv/bin/python scripts/prefix-cache-examples --update-doc"


def _script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("prefix_cache_examples", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _mismatch(in_doc: str, computed: str) -> str:
    """ "" when the doc's tables are the script's, else the diff and the command."""
    if in_doc == computed:
        return ""
    diff = "".join(
        difflib.unified_diff(
            in_doc.splitlines(keepends=True),
            computed.splitlines(keepends=True),
            "docs/prefix-caching.md",
            "scripts/prefix-cache-examples",
        )
    )
    return (
        "docs/prefix-caching.md's worked examples differ from the script's; "
        f"regenerate with `{REGENERATE}`:\n{diff}"
    )


def test_the_docs_worked_examples_are_the_scripts_output() -> None:
    script = _script()
    text = script.DOC.read_text()
    start, end = script.doc_tables(text)
    problem = _mismatch(text[start:end], script.tables())
    assert not problem, problem


def test_a_drifted_table_is_reported_with_its_diff_and_the_command() -> None:
    script = _script()
    text = script.DOC.read_text()
    start, end = script.doc_tables(text)
    # Qwen3-Next's repeated prompt under 0.33, moved by one token.
    drifted = text[start:end].replace("| 10,032 |", "| 10,031 |", 1)
    problem = _mismatch(drifted, script.tables())
    assert REGENERATE in problem
    assert "\n-| vllm-0.33 | 3× mamba / 528, full / 528 |" in problem, problem
    assert "10,031" in problem and "+| vllm-0.33 |" in problem, problem
