"""kvplan's --block-size rule (kvplan/models/block_sizes.py) against each vLLM release's
own attention backends, in the CPU venvs: for every platform and model kind, the sizes
1-256 that some candidate backend of `_get_backend_priorities` takes
(`supports_block_size`). A backend that cannot be imported on the CPU (no CUDA driver,
no FlashInfer) is read from its source instead: the literal sizes its
`get_supported_kernel_block_sizes` returns, following base classes and vLLM's
composite-backend factory; the answer says which were read so."""

from __future__ import annotations

import re

import pytest

from kvplan.models.block_sizes import BLOCK_SIZE_RULES, block_size_problem
from tests.vllm_envs import run_in_vllm

VERSIONS = ("0.32", "0.33", "0.34")

# Runs in the vLLM venv: every candidate backend's accepted sizes, per platform and kind.
VLLM_SIDE = r"""
import ast, importlib.util, json
import vllm
from vllm.v1.attention.backends.registry import AttentionBackendEnum

SIZES = range(1, 257)


def source_tree(module_name):
    return ast.parse(open(importlib.util.find_spec(module_name).origin).read())


def candidates(module_name):
    # The backends a platform's _get_backend_priorities can return: MLA, and not.
    tree = source_tree(module_name)
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                   and node.name == "_get_backend_priorities"]
    branch = next(node for node in ast.walk(function) if isinstance(node, ast.If)
                  and isinstance(node.test, ast.Name) and node.test.id == "use_mla")
    after = function.body[function.body.index(branch) + 1:]

    def names(nodes):
        return sorted({a.attr for node in nodes for a in ast.walk(node)
                       if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)
                       and a.value.id == "AttentionBackendEnum"})

    return {"mla": names(branch.body), "attention": names(branch.orelse + after)}


def literal_sizes(node, where):
    out = []
    for elt in node.elts:
        if isinstance(elt, ast.Constant) and isinstance(elt.value, int):
            out.append(elt.value)
        elif isinstance(elt, ast.Call) and getattr(elt.func, "id", "") == "MultipleOf":
            out.append(elt.args[0].value)
        else:
            raise ValueError(f"{where}: not a literal size: {ast.unparse(elt)}")
    return out


def static_bases(module_name, class_name):
    # Every literal size get_supported_kernel_block_sizes returns, from the source.
    tree = source_tree(module_name)
    imports = {alias.asname or alias.name: node.module for node in tree.body
               if isinstance(node, ast.ImportFrom) for alias in node.names}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if (isinstance(item, ast.FunctionDef)
                        and item.name == "get_supported_kernel_block_sizes"):
                    return [size for ret in ast.walk(item) if isinstance(ret, ast.Return)
                            for size in literal_sizes(ret.value, class_name)]
            base = node.bases[0].id
            if imports.get(base, "").endswith("attention.backend"):
                return [1]  # AttentionBackend's default: MultipleOf(1)
            return static_bases(imports.get(base, module_name), base)
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and any(getattr(target, "id", "") == class_name for target in node.targets)):
            for keyword in node.value.keywords:  # create_composite_attention_backend
                if keyword.arg == "kernel_block_sizes":
                    return literal_sizes(keyword.value, class_name)
    raise ValueError(f"{module_name}.{class_name}: kernel block sizes not found")


def sizes_of(name):
    backend = AttentionBackendEnum[name]
    try:
        cls = backend.get_class()
        return [n for n in SIZES if cls.supports_block_size(n)], "imported"
    except Exception as error:
        module_name, _, class_name = backend.get_path().rpartition(".")
        bases = static_bases(module_name, class_name)
        accepted = [n for n in SIZES if any(n % base == 0 for base in bases)]
        return accepted, f"source ({type(error).__name__} on import)"


out = {"release": vllm.__version__}
for platform in ("cuda", "rocm"):
    for kind, names in candidates(f"vllm.platforms.{platform}").items():
        seen = {name: sizes_of(name) for name in names}
        accepted = sorted(set().union(*(set(sizes) for sizes, _ in seen.values())))
        out[f"{platform}/{kind}"] = {
            "accepted": accepted, "backends": {k: how for k, (_, how) in seen.items()}
        }
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=VERSIONS)
def vllm_sizes(request: pytest.FixtureRequest) -> dict[str, object]:
    answer: dict[str, object] = run_in_vllm(request.param, ["-c", VLLM_SIDE])
    assert str(answer["release"]).startswith(request.param)
    return answer


@pytest.mark.parametrize(("platform", "mla"), sorted(BLOCK_SIZE_RULES))
def test_block_size_rule_is_vllms(vllm_sizes: dict[str, object], platform: str, mla: bool) -> None:
    seen = vllm_sizes[f"{platform}/{'mla' if mla else 'attention'}"]
    assert isinstance(seen, dict)
    backends: dict[str, str] = seen["backends"]
    # Most candidates are vLLM's own objects; the rest are named as read from source.
    assert sum(how == "imported" for how in backends.values()) >= len(backends) / 2, backends
    kvplan = [
        size
        for size in range(1, 257)
        if block_size_problem(size, platform=platform, mla=mla) is None
    ]
    assert kvplan == seen["accepted"], (platform, mla, backends)
    # The message names every backend kvplan lists as one vLLM considers there.
    named = re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", BLOCK_SIZE_RULES[(platform, mla)].backends)
    assert named and set(named) <= set(backends), (named, sorted(backends))
