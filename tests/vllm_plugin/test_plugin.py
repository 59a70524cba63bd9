"""The kvplan vLLM plugin through vLLM's own engine core, for vLLM 0.32, 0.33 and 0.34.

Each vLLM release runs in its own venv (scripts/vllm-venv builds them; `make test`
does so when they are missing). The plugin is installed from the project's wheel
into a test-only directory and found by vLLM through its entry point. Engines are
started by `EngineCore._initialize_kv_caches` in `engine_host.py`, one long-lived
process per release shared by the cases (vLLM's import is the slow part), against
a real `kvplan serve` on loopback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplan.client import ChannelSecurity, PlannerClient
from kvplan.client.fleet import model_config_hash
from kvplan.core.prefix_warnings import REPEATED_PROMPTS_ONLY
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.v1 import plan_pb2, service_pb2
from tests.vllm_envs import vllm_python

ROOT = Path(__file__).resolve().parents[2]
HOST = Path(__file__).resolve().parent / "engine_host.py"
VERSIONS = ("0.32", "0.33", "0.34")
GIB = 1 << 30
H100_TOTAL = GPU_MEMORY_BYTES["H100-80GB"]
OBSERVED_ENGINES = ("llama", "gemma3", "gpt-oss-eagle3", "deepseek-mtp", "qwen3-next-mtp")
# The engines whose drafter group vLLM flags, and the rule kvplan names for it. 0.33+
# flags the groups of `is_draft` layers. 0.32's specs have no `is_draft`: the MTP
# engine's drafter is found as the trailing layer; the EAGLE3 drafter is not found
# (not MTP), nor DeepSeek's (one uniform group: 0.32 flags on the hybrid paths only).
FLAGGED: dict[str, dict[str, str]] = {
    "0.32": {"qwen3-next-mtp": "trailing_layer"},
    "0.33": dict.fromkeys(("gpt-oss-eagle3", "deepseek-mtp", "qwen3-next-mtp"), "is_draft"),
    "0.34": dict.fromkeys(("gpt-oss-eagle3", "deepseek-mtp", "qwen3-next-mtp"), "is_draft"),
}

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel installed into a directory of its own (never into a venv)."""
    base = tmp_path_factory.mktemp("plugin")
    wheels = base / "wheels"
    # Offline and fast with the venv's own setuptools; isolated (PyPI) without it.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
         "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("kvplan-*.whl")
    site = base / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return site


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """`kvplan serve` from the project's venv on loopback, one H100-80GB, memory store."""

    def __init__(
        self, lease_ttl_s: float = 60.0, port: int | None = None, token_file: Path | None = None
    ) -> None:
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLAN_")}
        flags = ["--token-file", str(token_file)] if token_file else []
        # The server's log goes to a file: a pipe nobody reads fills up and drops lines.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "kvplan"), "serve", "--host", "127.0.0.1",
             "--port", str(self.port), "--metrics-port", "0", "--devices", "1xH100-80GB",
             "--store", "memory", "--lease-ttl-s", str(lease_ttl_s), "--grace-s", "1", *flags],
            env=env, stdout=subprocess.DEVNULL, stderr=self.log,
        )  # fmt: skip
        # An operator's token (the first line of the token file) reads the devices.
        token = token_file.read_text().split()[0] if token_file else None
        self.client = PlannerClient(self.addr, timeout_s=10, security=ChannelSecurity(token=token))
        deadline = time.monotonic() + 30
        while True:
            assert self.process.poll() is None, self.log_text()
            try:
                self.uuid = self.client.list_devices(timeout_s=0.5).devices[0].uuid
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def committed(self) -> int:
        return int(self.client.list_devices().devices[0].commit_limit_bytes) - int(
            self.client.list_devices().devices[0].available_to_grant_bytes
        )

    def close(self) -> None:
        self.client.close()
        # A call still open (a plugin's stream) holds the drain for the 1 s grace.
        self.process.terminate()
        try:
            assert self.process.wait(timeout=30) == 0, self.log_text()
        finally:
            self.log.close()

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]


class EngineHost:
    """One vLLM process that starts engines on command (see engine_host.py)."""

    def __init__(self, version: str, site: Path, env: dict[str, str]) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KVPLAN_", "VLLM_"))}
        base.update(env)
        base["PYTHONPATH"] = str(site)  # the installed wheel only, not the repository
        self.process = subprocess.Popen(
            [str(vllm_python(version)), str(HOST)],
            env=base,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.ready = self._read()
        assert self.ready.get("ready"), self.ready

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"engine host exited ({self.process.poll()})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def send(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def start(self, name: str, engine: str, **kw: Any) -> dict[str, Any]:
        kw.setdefault("memory", [20 * GIB])
        return self.send(op="start", name=name, engine=engine, **kw)

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(AssertionError, BrokenPipeError):
                self.send(op="exit")
            self.process.wait(timeout=30)


def plugin_lines(answer: dict[str, Any]) -> list[str]:
    return [line for line in answer.get("log", []) if "vllm.plugins.kvplan" in line]


def verdict(answer: dict[str, Any]) -> str:
    """The one line observe writes per engine start (agreement or the difference)."""
    (line,) = [
        x for x in plugin_lines(answer) if "kvplan agreement" in x or "kvplan DIFFERENCE" in x
    ]
    return line


@pytest.fixture(scope="module", params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = Server(lease_ttl_s=2.0)
    yield running
    running.close()


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine host's Hugging Face cache (HF_HUB_CACHE): models served by hub id."""
    return tmp_path_factory.mktemp("hub")


@pytest.fixture(scope="module")
def host(version: str, plugin_site: Path, server: Server, hub_cache: Path) -> Iterator[EngineHost]:
    env = {"KVPLAN_ADDR": server.addr, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    engine_host = EngineHost(version, plugin_site, env)
    yield engine_host
    engine_host.close()


def test_spec_mapping_round_trips_every_spec_class(host: EngineHost, version: str) -> None:
    result = host.send(op="roundtrip")
    assert result["failures"] == []
    # Every kvplan kind is exercised, and every vLLM spec class is mapped or refused.
    assert len(result["kinds"]) == 14, result["kinds"]
    assert {"hisparse_hot", "hisparse_resident"} <= set(result["kinds"])
    assert result["unmapped"] == [], result["unmapped"]
    assert "MambaSpec" in result["classes"] and "HiSparseHotSpec" in result["classes"]
    assert len(result["refused"]) == 3, result["refused"]
    if version == "0.34":  # head-major slots exist: the layer builds (and round-trips above)
        assert result["built_across_releases"] == "built"
    else:  # 0.32 and 0.33 have no such field: refused by name, never dropped
        assert (
            "kv_head_major_slots=True does not exist in this vLLM release's"
            in (result["built_across_releases"])
        ), result
    if version == "0.32":  # no is_draft: a drafter layer cannot be built, and says so
        assert result["drafter_built"] == (
            "layer 'drafter': is_draft=True does not exist in this vLLM release's FullAttentionSpec"
        ), result
    else:
        assert result["drafter_built"] == "built", result
    assert "storage dtype torch.int32" in result["refused"][0]
    assert "UniformTypeKVCacheSpecs has no kvplan LayerSpec kind" in result["refused"][1]


def test_conformance_builds_specs_through_the_mapping(host: EngineHost) -> None:
    # conformance/vllm_driver.py builds every scenario layer with the plugin's
    # mapping (LayerSpec -> vLLM); reading each back (vLLM -> LayerSpec) and building
    # it again gives the same spec: the two directions agree on all of them.
    result = host.send(op="conformance_direction", repo=str(ROOT))
    assert result.get("driver_uses_the_mapping") is True, result
    assert result["mismatches"] == [], result
    assert result["compared"] > 900, result


# --- observe ------------------------------------------------------------------------------


def test_plugin_loads_through_its_entry_point(host: EngineHost, version: str) -> None:
    (line,) = plugin_lines(host.ready)
    assert f"kvplan plugin active for vLLM {version}.0" in line
    assert host.send(op="wrapped")["wrapped"] is True


def test_the_load_time_check_tells_the_releases_apart(host: EngineHost, version: str) -> None:
    # Each release's table checked against this vLLM's own modules: its own passes,
    # and the others name what differs (0.32 makes the global groups inside a
    # 3-parameter get_kv_cache_configs, with kv_cache_utils.get_kv_cache_groups).
    made_inside = "('vllm_config', 'kv_cache_specs', 'available_memory')"
    passed = "('vllm_config', 'kv_cache_specs', 'available_memory', 'global_kv_cache_groups')"
    expected = {
        "0.32": {
            "0.32": [],
            "0.33": [f"get_kv_cache_configs{made_inside} != {passed}"],
            "0.34": [
                f"get_kv_cache_configs{made_inside} != {passed}",
                "finalize_extensible_kv_cache is missing",
            ],
        },
        "0.33": {
            "0.32": [
                f"get_kv_cache_configs{passed} != {made_inside}",
                "kv_cache_utils.get_kv_cache_groups is missing",
            ],
            "0.33": [],
            "0.34": ["finalize_extensible_kv_cache is missing"],
        },
        "0.34": {
            "0.32": [
                f"get_kv_cache_configs{passed} != {made_inside}",
                "kv_cache_utils.get_kv_cache_groups is missing",
            ],
            "0.33": [],  # 0.34 has all 0.33 wraps; the gate picks the table by version
            "0.34": [],
        },
    }[version]
    assert host.send(op="signatures") == expected


@pytest.mark.parametrize("engine", OBSERVED_ENGINES)
def test_observe_agrees(host: EngineHost, server: Server, version: str, engine: str) -> None:
    answer = host.start(engine, engine)
    assert answer["ok"], answer
    line = verdict(answer)
    assert "kvplan agreement" in line, line
    if version == "0.34":  # vLLM sizes the extensible cache again after warm-up
        assert any("extensible KV cache settled at" in x for x in plugin_lines(answer))
        assert answer["init"]["extended"] == answer["init"]["num_blocks"][0]
    else:
        # The verdict, then the prefix-cache line.
        assert len(plugin_lines(answer)) == 2, plugin_lines(answer)
    prefix = plugin_lines(answer)[1]
    assert "kvplan prefix cache: " in prefix, plugin_lines(answer)
    # Mamba groups and short sliding windows: only repeated prompts hit, said plainly.
    if engine in ("gemma3", "gpt-oss-eagle3", "qwen3-next-mtp"):
        assert prefix.startswith("WARNING") and REPEATED_PROMPTS_ONLY in prefix, prefix
    else:
        assert REPEATED_PROMPTS_ONLY not in prefix, prefix
    plan_id = re.search(r"plan (plan-[0-9a-f]+)", line)
    assert plan_id is not None, line
    # The operator can fetch the plan the line names; it is the engine's.
    plan = server.client.get_plan(plan_id=plan_id.group(1))
    init = answer["init"]
    assert plan.num_blocks == init["num_blocks"][0]
    assert [list(g.layer_names) for g in plan.response.groups] == [
        g["layers"] for g in init["groups"]
    ]
    assert [g.is_draft for g in plan.response.groups] == [g["is_draft"] for g in init["groups"]]
    assert plan.response.rule_set == f"vllm-{version}"
    # The workers' supported layouts travelled (the stand-in executor reports LBNHC).
    assert list(plan.response.diagnostics.layout_candidates) == [plan_pb2.KV_CACHE_LAYOUT_LBNHC]
    rule = FLAGGED[version].get(engine)
    assert any(g["is_draft"] for g in init["groups"]) == (rule is not None)
    if rule is not None:
        assert f"({rule})" in line, line
    else:
        assert "draft groups {}" in line, line


def test_observe_agrees_on_mamba_state_alignment(
    host: EngineHost, server: Server, version: str
) -> None:
    # Mamba states padded to 64 KiB each (vLLM 0.34's MambaSpec.state_alignment,
    # sent as state_alignment_bytes) and a 64 KiB block stride (both releases).
    plain = host.start("unaligned", "qwen3-next-mtp")
    answer = host.start("aligned", "qwen3-next-mtp-aligned")
    assert answer["ok"], answer
    line = verdict(answer)
    assert "kvplan agreement" in line and f"({FLAGGED[version]['qwen3-next-mtp']})" in line, line
    plan_id = re.search(r"plan (plan-[0-9a-f]+)", line)
    assert plan_id is not None, line
    plan = server.client.get_plan(plan_id=plan_id.group(1))
    assert plan.num_blocks == answer["init"]["num_blocks"][0]
    blocks, unaligned = answer["init"]["num_blocks"][0], plain["init"]["num_blocks"][0]
    # The unaligned page is 16 KiB (states of 4 and 12 KiB).
    if version == "0.34":  # each state padded to 64 KiB: a 128 KiB page, 8x
        assert blocks == unaligned // 8, (blocks, unaligned)
    else:  # 0.32, 0.33: the 64 KiB block stride alone pads the page to 64 KiB, 4x
        assert blocks == unaligned // 4, (blocks, unaligned)


def test_observe_agrees_on_auto_fit_and_a_block_override(host: EngineHost, server: Server) -> None:
    # 2 GiB for a 131,072-token Llama: vLLM fits max_model_len to the memory.
    fitted = host.start("fit", "llama-auto-fit", memory=[2 * GIB])
    assert fitted["ok"], fitted
    line = verdict(fitted)
    assert "kvplan agreement" in line, line
    plan_id = re.search(r"plan (plan-[0-9a-f]+)", line)
    assert plan_id is not None
    plan = server.client.get_plan(plan_id=plan_id.group(1))
    assert fitted["init"]["max_model_len"] < 131072
    assert plan.max_model_len == fitted["init"]["max_model_len"]
    overridden = host.start("override", "llama-override")
    line = verdict(overridden)
    assert "kvplan agreement" in line, line
    assert overridden["init"]["num_blocks"] == [1000]
    # 0.34 turns its extensible cache off for a block override; the plugin says so,
    # and kvplan plans the classic cache (not the reservation 0.34 defaults to).
    plan_id = re.search(r"plan (plan-[0-9a-f]+)", line)
    assert plan_id is not None
    plan = server.client.get_plan(plan_id=plan_id.group(1))
    assert plan.response.plan_stage == plan_pb2.PLAN_STAGE_CLASSIC


def test_observe_agrees_on_a_tensor_parallel_engine(host: EngineHost) -> None:
    # Two ranks that measured different memory: every rank gets the smaller count.
    answer = host.start("tp2", "llama-tp2", memory=[20 * GIB, 18 * GIB])
    assert answer["ok"], answer
    assert "kvplan agreement" in verdict(answer)
    bytes_per_block = 2 * 4 * 128 * 2 * 16 * 32
    assert answer["init"]["num_blocks"] == [18 * GIB // bytes_per_block] * 2


def test_observe_carries_the_flag_all_warning(host: EngineHost, version: str) -> None:
    # EAGLE on a hybrid Mamba model with no drafter layer marked: neither vLLM nor
    # kvplan can name the draft group, and consumers would flag every group.
    answer = host.start("eagle", "qwen3-next-eagle-unmarked")
    assert answer["ok"], answer
    line = verdict(answer)
    assert "kvplan agreement" in line and "draft groups {}" in line, line
    assert ", warning: " in line and "Mamba" in line, line
    # The prefix cache, for vLLM's own (agreeing) setup: 0.32 drops a block of every
    # group (none is the drafter's), named with its knob; 0.33+ hash the drafter's
    # lookahead instead of dropping, and hits are as usual.
    (prefix,) = [x for x in plugin_lines(answer) if "kvplan prefix cache" in x]
    assert "vLLM's own setup" in prefix and "ZERO HITS expected" not in prefix, prefix
    # Its Mamba groups: in every release only repeated prompts hit.
    assert prefix.startswith("WARNING") and REPEATED_PROMPTS_ONLY in prefix, prefix
    if version == "0.32":
        assert "FEWER HITS expected" in prefix and "is_draft" in prefix, prefix
    else:
        assert "ZERO SHARED-PREFIX HITS expected" in prefix, prefix


def test_observe_warns_when_vllms_own_setup_gets_zero_prefix_hits(host: EngineHost) -> None:
    # max_model_len 64 with 64-token blocks: the shortest prefix that hits is longer
    # than any request (a block, plus the drafter's drop or hash lookahead).
    answer = host.start("short", "deepseek-mtp-short")
    assert answer["ok"], answer
    assert "kvplan agreement" in verdict(answer)
    (prefix,) = [x for x in plugin_lines(answer) if "kvplan prefix cache" in x]
    assert prefix.startswith("WARNING"), prefix
    assert "ZERO HITS expected for vLLM's own setup" in prefix, prefix
    assert "longer than max_model_len (64)" in prefix and "--block-size" in prefix, prefix


def test_observe_reports_a_planted_difference_and_changes_nothing(
    host: EngineHost, version: str
) -> None:
    if version == "0.32":
        # 0.32 flags the spec marker's group and the last layer's, both at once (here
        # every group); kvplan's own rules (KVPLAN_RULES=kvplan) let the marker decide.
        answer = host.start("planted", "mla-swa-marked-drafter", env={"KVPLAN_RULES": "kvplan"})
        expected = "DIFFERENCE (draft flags: vLLM {0, 1} kvplan {0 (spec_marker)})"
        flags = [True, True]
    else:
        # vLLM flags no drafter group on a hybrid MTP engine whose MTP layer is not
        # marked; kvplan's own rules flag it by the trailing layer.
        answer = host.start("planted", "qwen3-next-mtp-unmarked", env={"KVPLAN_RULES": "kvplan"})
        expected = "DIFFERENCE (draft flags: vLLM {} kvplan {2 (trailing_layer)})"
        flags = [False, False, False]
    assert answer["ok"], answer
    line = verdict(answer)
    assert line.startswith("WARNING"), line
    assert expected in line, line
    assert "num_blocks" in line and "plan plan-" in line
    assert [g["is_draft"] for g in answer["init"]["groups"]] == flags


def test_draft_flags_on_an_unmarked_hybrid_mtp_engine(host: EngineHost, version: str) -> None:
    observed = host.start("unfixed", "qwen3-next-mtp-unmarked")
    before = host.send(op="counters")["draft_flag_changes"]
    answer = host.start("fixed", "qwen3-next-mtp-unmarked", env={"KVPLAN_MODE": "draft-flags"})
    assert answer["ok"], answer
    groups = answer["init"]["groups"]
    assert "mtp.layers.0.self_attn.attn" in groups[2]["layers"]
    if version == "0.32":
        # 0.32 finds the MTP layer itself (the trailing layer): kvplan's rules agree,
        # and draft-flags mode changes nothing.
        assert [g["is_draft"] for g in observed["init"]["groups"]] == [False, False, True]
        summary, prefix = plugin_lines(answer)
        assert "kvplan agreement" in summary and "draft groups {2 (trailing_layer)}" in summary
        assert "kvplan prefix cache: " in prefix and "vLLM's own setup" in prefix, prefix
        assert host.send(op="counters")["draft_flag_changes"] == before
    else:
        assert [g["is_draft"] for g in observed["init"]["groups"]] == [False, False, False]
        change, summary = plugin_lines(answer)[:2]
        assert change.startswith("WARNING"), change
        assert "CHANGED vLLM's draft flags from {} to {2}" in change
        assert "group 2: trailing_layer" in change
        assert "kvplan agreement" in summary
        assert host.send(op="counters")["draft_flag_changes"] == before + 1
    assert [g["is_draft"] for g in groups] == [False, False, True]
    assert answer["init"]["scheduler_draft"] == [False, False, True]
    # Same block count: the flag changes which group takes the EAGLE block drop.
    assert answer["init"]["num_blocks"] == observed["init"]["num_blocks"]


def test_draft_flags_takes_kvplans_flags_for_a_spec_marked_drafter(
    host: EngineHost, version: str
) -> None:
    # The drafter's MLA layer carries the spec marker; its sliding-window layer is
    # registered last. vLLM 0.32 flags the marker's group and the last layer's: every
    # group. 0.33+ flags none (no layer is_draft). kvplan's own rules flag the
    # marker's group, and the plugin sets that on vLLM's global groups before they
    # are projected onto the workers: the worker's config carries it.
    if version == "0.32":
        vllm_flags, flags, rules = "{0, 1}", [True, True], "{0 (spec_marker), 1 (trailing_layer)}"
    else:
        vllm_flags, flags, rules = "{}", [False, False], "{}"
    observed = host.start("marker-observed", "mla-swa-marked-drafter")
    assert observed["ok"], observed
    line = verdict(observed)  # vLLM against its own release's rules
    assert "kvplan agreement" in line and f"draft groups {rules}" in line, line
    assert [g["is_draft"] for g in observed["init"]["groups"]] == flags
    assert observed["init"]["scheduler_draft"] == flags
    before = host.send(op="counters")["draft_flag_changes"]
    answer = host.start(
        "marker-fixed", "mla-swa-marked-drafter", env={"KVPLAN_MODE": "draft-flags"}
    )
    assert answer["ok"], answer
    change, summary = plugin_lines(answer)[:2]
    assert change.startswith("WARNING"), change
    assert f"CHANGED vLLM's draft flags from {vllm_flags} to {{0}}" in change, change
    assert "group 0: spec_marker" in change, change
    assert "kvplan agreement" in summary and "draft groups {0 (spec_marker)}" in summary, summary
    groups = answer["init"]["groups"]
    assert "mtp.layers.0.self_attn.attn" in groups[0]["layers"]
    assert groups[1]["layers"][-1] == "mtp.layers.0.self_attn.swa"
    assert [g["is_draft"] for g in groups] == [True, False]
    assert answer["init"]["scheduler_draft"] == [True, False]
    assert host.send(op="counters")["draft_flag_changes"] == before + 1
    assert answer["init"]["num_blocks"] == observed["init"]["num_blocks"]


def test_draft_flags_leaves_a_marked_engine_alone(host: EngineHost) -> None:
    answer = host.start("marked", "qwen3-next-mtp", env={"KVPLAN_MODE": "draft-flags"})
    assert answer["ok"], answer
    assert "kvplan agreement" in verdict(answer)
    assert not any("CHANGED" in x for x in plugin_lines(answer))


def test_both_refusing_is_an_agreement_not_a_fallback(host: EngineHost) -> None:
    """An engine too large for its memory: kvplan refuses it (RESOURCE_EXHAUSTED), and
    so does vLLM's own planner. The plugin logs the agreement and counts it apart
    from the fallbacks (which stay for an unreachable kvplan); vLLM's error stops
    the start, as it would without the plugin."""
    before = host.send(op="counters")
    answer = host.start("too-small", "llama", memory=[64 << 20])
    assert not answer["ok"], answer
    lines = plugin_lines(answer)
    assert len(lines) == 1 and lines[0].startswith("WARNING"), lines
    line = lines[0]
    assert "[kvplan-plugin]" in line and "kvplan and vLLM both refuse engine" in line, line
    assert "RESOURCE_EXHAUSTED" in line and "fallback" not in line, line
    after = host.send(op="counters")
    assert after["refusals_agreed"] == before["refusals_agreed"] + 1
    assert after["fallbacks"] == before["fallbacks"]


def test_an_engine_without_kv_cache_groups_cannot_prefix_cache_in_vllm_either(
    host: EngineHost, version: str
) -> None:
    """Issue 31 §5: no layer needs a KV cache and prefix caching is forced on. vLLM's
    configuration keeps it on, its engine core plans the cache with no group, and the
    scheduler's KV cache manager then fails: kvplan's refusal (INVALID_ARGUMENT)
    says so, quoting vLLM; with prefix caching off both plan it."""
    from kvplan.convert import plan_from_proto
    from kvplan.core.errors import PlanningError

    on = host.send(op="without_kv_groups", prefix_caching=True)
    off = host.send(op="without_kv_groups", prefix_caching=False)
    assert on["groups"] == off["groups"] == 0
    assert not on["ok"] and on["error"] == (
        "AssertionError: HybridKVCacheCoordinator requires at least one cacheable group."
    ), on
    assert off["ok"] and off["coordinator"] == "KVCacheCoordinatorNoPrefixCache", off
    request = plan_pb2.PlanRequest(engine_id="no-kv")
    request.options.max_model_len = 4096
    request.options.engine_version = f"vllm-{version}"
    request.options.enable_prefix_caching = True
    worker = request.workers.add(rank=0)
    worker.memory.kv_cache_memory_bytes = 1 << 30
    with pytest.raises(PlanningError) as refused:
        plan_from_proto(request)
    assert refused.value.code == "INVALID_ARGUMENT"
    assert refused.value.field == "options.enable_prefix_caching"
    assert on["error"].split(": ", 1)[1] in refused.value.message
    request.options.enable_prefix_caching = False
    assert plan_from_proto(request).workers  # both plan it without prefix caching


# --- kvplan down ---------------------------------------------------------------------------


def test_kvplan_down_observe_falls_back_lease_refuses(host: EngineHost, server: Server) -> None:
    dead = f"127.0.0.1:{free_port()}"
    before = host.send(op="counters")["fallbacks"]
    observed = host.start("down", "llama", env={"KVPLAN_ADDR": dead, "KVPLAN_TIMEOUT_S": "1"})
    assert observed["ok"], observed
    warning = plugin_lines(observed)[0]
    assert warning.startswith("WARNING") and "vLLM's own plan stands" in warning, warning
    assert host.send(op="counters")["fallbacks"] == before + 1
    assert observed["init"]["num_blocks"] == [20 * GIB // (2 * 8 * 128 * 2 * 16 * 32)]

    refused = host.start(
        "down-lease", "llama", utilization=0.45, uuid=server.uuid,
        env={"KVPLAN_ADDR": dead, "KVPLAN_MODE": "lease", "KVPLAN_TIMEOUT_S": "1"},
    )  # fmt: skip
    assert not refused["ok"]
    assert "LeaseRefused" in refused["error"] and "unreachable" in refused["error"]
    assert "KVPLAN_ON_UNAVAILABLE=refuse" in refused["error"]

    # A kvplan that accepts connections and never answers: the deadline ends the wait.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        slow = host.start(
            "slow", "llama",
            env={"KVPLAN_ADDR": f"127.0.0.1:{silent.getsockname()[1]}", "KVPLAN_TIMEOUT_S": "1"},
        )  # fmt: skip
        waited = time.monotonic() - started
    assert slow["ok"], slow
    assert "DEADLINE_EXCEEDED" in plugin_lines(slow)[0], plugin_lines(slow)
    assert 1.0 <= waited < 10, waited
    assert host.send(op="counters")["fallbacks"] == before + 2

    served = host.start(
        "down-serve", "llama", utilization=0.45, uuid=server.uuid,
        env={"KVPLAN_ADDR": dead, "KVPLAN_MODE": "lease", "KVPLAN_TIMEOUT_S": "1",
             "KVPLAN_ON_UNAVAILABLE": "serve"},
    )  # fmt: skip
    assert served["ok"], served
    assert any("starting unleased" in line for line in plugin_lines(served))


def test_lease_through_a_token_protected_server(host: EngineHost, tmp_path: Path) -> None:
    """The plugin sends the client's KVPLAN_TOKEN; without it the server refuses and
    lease mode stops the start with the server's reason."""
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "operator-token-0123456789 ops operator\nengine-token-0123456789 engine-owner\n"
    )
    tokens.chmod(0o600)
    protected = Server(token_file=tokens)
    try:
        leased = host.start(
            "with-token", "llama", utilization=0.45, uuid=protected.uuid,
            env={"KVPLAN_ADDR": protected.addr, "KVPLAN_MODE": "lease",
                 "KVPLAN_TOKEN": "engine-token-0123456789"},
        )  # fmt: skip
        assert leased["ok"], leased
        assert protected.committed() > 0
        refused = host.start(
            "without-token", "llama", utilization=0.45, uuid=protected.uuid,
            env={"KVPLAN_ADDR": protected.addr, "KVPLAN_MODE": "lease"},
        )  # fmt: skip
        assert not refused["ok"]
        assert "LeaseRefused" in refused["error"] and "no credentials" in refused["error"]
    finally:
        protected.close()


# --- lease ------------------------------------------------------------------------------------


def _lease_kv(server: Server, engine_id: str) -> tuple[int, int, int]:
    plan = server.client.get_plan(engine_id=engine_id).response
    worker = plan.workers[0]
    (lease,) = plan.leases
    return int(worker.budget.available_bytes), int(worker.bytes_per_block), int(lease.bytes)


def test_lease_two_engines_share_a_gpu_a_third_is_refused(
    host: EngineHost, server: Server, version: str, plugin_site: Path
) -> None:
    lease = {"KVPLAN_MODE": "lease"}
    # The worker's GPU reads 81 GiB; kvplan's inventory says 80: the lease binds.
    common: dict[str, Any] = {
        "utilization": 0.45, "uuid": server.uuid, "total": 81 * GIB, "memory": [21 * GIB],
        "warmup_blocks": 10**7,
    }  # fmt: skip
    a = host.start("A", "llama", env={**lease, "KVPLAN_ENGINE_ID": f"a-{version}"}, **common)
    b = host.start("B", "gemma3", env={**lease, "KVPLAN_ENGINE_ID": f"b-{version}"}, **common)
    for answer, engine_id in ((a, f"a-{version}"), (b, f"b-{version}")):
        assert answer["ok"], answer
        kv, bytes_per_block, footprint = _lease_kv(server, engine_id)
        assert footprint == math.ceil(H100_TOTAL * 0.45)
        assert kv < 21 * GIB  # min(measured, lease) took the lease
        assert answer["init"]["num_blocks"][0] == kv // bytes_per_block
        assert any(f"leased {footprint / GIB:.2f} GiB" in x for x in plugin_lines(answer))
        if version == "0.34":  # the extensible cache settles on the lease's cap
            assert answer["init"]["extended"] == kv // bytes_per_block
            assert any("extensible KV cache settled at" in x for x in plugin_lines(answer))
    assert server.committed() == 2 * math.ceil(H100_TOTAL * 0.45)
    # Heartbeats (every TTL/3) report each started engine's footprint as allocated.
    footprint = math.ceil(H100_TOTAL * 0.45)
    deadline = time.monotonic() + 5
    while not all(host.send(op="lease_state", name=n)["renewals"] >= 2 for n in ("A", "B")):
        assert time.monotonic() < deadline, "no heartbeats"
        time.sleep(0.2)
    state = host.send(op="lease_state", name="A")
    assert state["allocations"] == {"0": footprint} and state["interval_s"] == pytest.approx(2 / 3)
    assert server.client.list_devices().devices[0].outstanding_bytes == 0

    c = host.start("C", "llama", env={**lease, "KVPLAN_ENGINE_ID": f"c-{version}"}, **common)
    assert not c["ok"]
    assert "LeaseRefused: kvplan refused the KV-cache lease" in c["error"]
    share, left = footprint / GIB, (H100_TOTAL - 2 * footprint) / GIB
    assert f"asks for {share:.2f} GiB" in c["error"] and f"{left:.2f} GiB left" in c["error"]
    # Who holds the rest (a server without authentication names every holder).
    assert (
        f"Held by: engine 'a-{version}' (rank 0) {share:.2f} GiB, "
        f"engine 'b-{version}' (rank 0) {share:.2f} GiB."
    ) in c["error"], c["error"]

    # Shutting an engine down gives its lease back at once.
    shut = host.send(op="shutdown", name="A")
    assert shut["ok"], shut
    assert any("released the leases" in x for x in plugin_lines(shut)), shut
    assert server.committed() == math.ceil(H100_TOTAL * 0.45)

    # A killed engine's lease returns after its TTL (2 s here), not before.
    doomed = EngineHost(version, plugin_site, {"KVPLAN_ADDR": server.addr})
    try:
        k = doomed.start("K", "llama", env={**lease, "KVPLAN_ENGINE_ID": f"k-{version}"}, **common)
        assert k["ok"], k
        assert server.committed() == 2 * math.ceil(H100_TOTAL * 0.45)
        time.sleep(2.5)  # heartbeats keep it alive past one TTL
        assert server.committed() == 2 * math.ceil(H100_TOTAL * 0.45)
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=10)
    finally:
        doomed.close()
    refused = host.start("C", "llama", env={**lease, "KVPLAN_ENGINE_ID": f"c-{version}"}, **common)
    assert not refused["ok"]
    deadline = time.monotonic() + 10
    while server.committed() > math.ceil(H100_TOTAL * 0.45):
        assert time.monotonic() < deadline, "the killed engine's lease never expired"
        time.sleep(0.25)
    c = host.start("C", "llama", env={**lease, "KVPLAN_ENGINE_ID": f"c-{version}"}, **common)
    assert c["ok"], c
    for name in ("B", "C"):
        assert host.send(op="shutdown", name=name)["ok"]
    assert server.committed() == 0


def test_lease_follows_the_releases_default_utilization(
    host: EngineHost, server: Server, version: str
) -> None:
    # No --gpu-memory-utilization: 0.32 and 0.33 apply 0.92; 0.34's extensible KV cache
    # 1.0, so its engine leases the whole GPU (docs/vllm.md: set it when co-locating).
    expected = {"0.32": 0.92, "0.33": 0.92, "0.34": 1.0}[version]
    engine_id = f"default-{version}"
    answer = host.start(
        "D", "llama", utilization=None, uuid=server.uuid,
        env={"KVPLAN_MODE": "lease", "KVPLAN_ENGINE_ID": engine_id},
    )  # fmt: skip
    assert answer["ok"], answer
    (lease,) = server.client.get_plan(engine_id=engine_id).response.leases
    assert lease.bytes == math.ceil(H100_TOTAL * expected)
    assert host.send(op="shutdown", name="D")["ok"]
    assert server.committed() == 0


# --- the fleet's measurements -----------------------------------------------------------------


def model_dir(base: Path, **config: Any) -> tuple[Path, dict[str, Any]]:
    values = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, **config}
    base.mkdir()
    (base / "config.json").write_text(json.dumps({**values, "torch_dtype": "bfloat16"}))
    return base, values


def test_the_fleet_learns_and_a_measured_configuration_skips_profiling(
    host: EngineHost, server: Server, version: str, tmp_path: Path, hub_cache: Path
) -> None:
    model, config = model_dir(tmp_path / "llama", note=f"fleet-{version}")
    requested = math.ceil(80 * GIB * 0.9)
    # Every mode reports what the workers measured: observe here.
    first = host.start("F1", "llama", memory=[20 * GIB], model_dir=str(model))
    assert first["ok"], first
    assert first["init"]["profiled"] == [True]
    assert any("reported the measurements of engine" in x for x in plugin_lines(first)), first
    fingerprint = service_pb2.ConfigFingerprint(
        model_config_hash=model_config_hash(config),
        engine_version=f"vllm-{version}",
        gpu_name="H100",
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        dtype="bfloat16",
    )
    (engine,) = server.client.get_measurements(fingerprint).engines
    assert engine.release == f"{version}.0"
    assert (engine.max_num_batched_tokens, engine.cuda_graphs) == (8192, "FULL_AND_PIECEWISE:512")
    (worker,) = engine.workers
    assert (worker.available_kv_bytes, worker.requested_bytes, worker.total_bytes) == (
        20 * GIB,
        requested,
        80 * GIB,
    )
    assert worker.weights_bytes == 16 * GIB
    assert worker.activation_peak_bytes == (requested - 20 * GIB) // 4
    assert worker.cuda_graph_bytes == GIB // 4

    # draft-flags, opted in: the configuration was measured, so the worker gets
    # kv_cache_memory_bytes = requested - the measured non-KV memory and does not
    # profile (the stand-in's profile would now leave 18 GiB: not used).
    reuse = {"KVPLAN_REUSE_MEASUREMENTS": "1"}
    second = host.start(
        "F2", "llama", memory=[18 * GIB], model_dir=str(model),
        env={"KVPLAN_MODE": "draft-flags", **reuse},
    )  # fmt: skip
    assert second["ok"], second
    assert second["init"]["profiled"] == [False]
    assert second["init"]["num_blocks"] == first["init"]["num_blocks"]
    (line,) = [x for x in plugin_lines(second) if "skips its memory profiling" in x]
    assert "measured on 1 engine:" in line and f"kv_cache_memory_bytes={20 * GIB} " in line, line
    # A start that did not profile reports nothing.
    assert len(server.client.get_measurements(fingerprint).engines) == 1

    # lease, opted in: the lease asks for the utilization with the measured non-KV.
    third = host.start(
        "F3", "llama", memory=[18 * GIB], model_dir=str(model), uuid=server.uuid,
        env={"KVPLAN_MODE": "lease", "KVPLAN_ENGINE_ID": f"fleet-{version}", **reuse},
    )  # fmt: skip
    assert third["ok"], third
    assert third["init"]["profiled"] == [False]
    assert any("vLLM measured 20.00 GiB" in x for x in plugin_lines(third)), third
    assert host.send(op="shutdown", name="F3")["ok"]

    # A configuration never measured: vLLM profiles, and then it is measured.
    other, other_config = model_dir(tmp_path / "other", note=f"other-{version}")
    fourth = host.start(
        "F4", "llama", memory=[18 * GIB], model_dir=str(other),
        env={"KVPLAN_MODE": "draft-flags", **reuse},
    )  # fmt: skip
    assert fourth["ok"], fourth
    assert fourth["init"]["profiled"] == [True]
    assert any("was not measured before: vLLM profiles" in x for x in plugin_lines(fourth))
    fingerprint.model_config_hash = model_config_hash(other_config)
    assert len(server.client.get_measurements(fingerprint).engines) == 1
    # The start times (pytest -s): the stand-in's profiling costs nothing on the CPU,
    # so these are the plugin's own costs (docs/vllm.md quotes them).
    print(
        f"vLLM {version} EngineCore._initialize_kv_caches, draft-flags: measured configuration "
        f"(reused) {second['init']['seconds']:.3f} s, unmeasured (profiled, reported) "
        f"{fourth['init']['seconds']:.3f} s"
    )

    # A model served by hub id: its config.json from the local cache vLLM loaded it from.
    repo = f"kvplan-test/llama-{version}"
    snapshot = hub_cache / f"models--kvplan-test--llama-{version}" / "snapshots" / "0123abcd"
    hub_config = {"architectures": ["LlamaForCausalLM"], "note": f"hub-{version}"}
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(hub_config))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    hub = host.start("F6", "llama", memory=[19 * GIB], model_dir=repo)
    assert hub["ok"] and any("reported the measurements" in x for x in plugin_lines(hub)), hub
    fingerprint.model_config_hash = model_config_hash(hub_config)
    (engine,) = server.client.get_measurements(fingerprint).engines
    assert engine.workers[0].available_kv_bytes == 19 * GIB

    # Observe never changes the KV cache: the opt-in there stops the start, by name.
    refused = host.start("F5", "llama", model_dir=str(model), env=reuse)
    assert not refused["ok"] and "KVPLAN_REUSE_MEASUREMENTS" in refused["error"], refused


REPEATS = 15


def test_start_time_with_and_without_reuse(
    host: EngineHost, server: Server, version: str, tmp_path: Path
) -> None:
    # EngineCore._initialize_kv_caches, draft-flags, REPEATS times each, interleaved so
    # drift hits both alike: a configuration measured before (the worker is handed
    # kv_cache_memory_bytes and does not profile) against one started without the
    # opt-in (it profiles and reports). On the CPU the stand-in's profile costs
    # nothing, so the difference is what the plugin adds on each path, never the GPU's
    # saving (docs/vllm.md says what that is); pytest -s prints the figures quoted there.
    model, _ = model_dir(tmp_path / "llama", note=f"timing-{version}")
    first = host.start("T0", "llama", memory=[20 * GIB], model_dir=str(model))
    assert first["ok"] and first["init"]["profiled"] == [True], first
    reuse = {"KVPLAN_MODE": "draft-flags", "KVPLAN_REUSE_MEASUREMENTS": "1"}
    profile = {"KVPLAN_MODE": "draft-flags"}
    seconds: dict[str, list[float]] = {"reused": [], "profiled": []}
    for repeat in range(REPEATS):
        for label, env in (("reused", reuse), ("profiled", profile)):
            # Every profile measures 20 GiB, so the fleet's answer stays 20 GiB; a reused
            # start would have measured 18 GiB, and gets the fleet's 20 GiB instead.
            memory = 18 * GIB if label == "reused" else 20 * GIB
            answer = host.start(
                f"T{label}{repeat}", "llama", memory=[memory], model_dir=str(model), env=env
            )
            assert answer["ok"], answer
            assert answer["init"]["profiled"] == [label == "profiled"], (label, answer)
            assert answer["init"]["num_blocks"] == first["init"]["num_blocks"], answer
            seconds[label].append(answer["init"]["seconds"])
    figures = {
        label: (statistics.median(values), min(values), max(values))
        for label, values in seconds.items()
    }
    print(
        f"vLLM {version} CPU, _initialize_kv_caches x{REPEATS}: "
        + "; ".join(
            f"{label} median {median * 1000:.1f} ms (min {low * 1000:.1f}, max {high * 1000:.1f})"
            for label, (median, low, high) in figures.items()
        )
    )


def test_a_lost_lease_is_reported(host: EngineHost, version: str) -> None:
    # kvplan restarts with an in-memory store: the engine's lease is gone, and the
    # next heartbeat says so (the engine keeps serving; the operator restarts it).
    first = Server(lease_ttl_s=2.0)
    try:
        answer = host.start(
            "L", "llama", utilization=0.45, uuid=first.uuid,
            env={"KVPLAN_ADDR": first.addr, "KVPLAN_MODE": "lease",
                 "KVPLAN_ENGINE_ID": f"lost-{version}"},
        )  # fmt: skip
        assert answer["ok"], answer
    finally:
        first.close()
    second = Server(lease_ttl_s=2.0, port=first.port)
    try:
        deadline = time.monotonic() + 10
        lines: list[str] = []
        while not any("are gone" in x for x in lines):
            assert time.monotonic() < deadline, lines
            time.sleep(0.3)
            lines += plugin_lines(host.send(op="log"))
        (lost,) = [x for x in lines if "are gone" in x]
        assert lost.startswith("ERROR") and f"engine lost-{version}" in lost
        assert "restart this engine to lease again" in lost
        shut = host.send(op="shutdown", name="L")  # nothing left to release
        assert shut["ok"], shut
        assert any("had no leases left to release" in x for x in plugin_lines(shut)), shut
    finally:
        second.close()


# --- inert without KVPLAN_ADDR ------------------------------------------------------------------


def test_inert_without_kvplan_addr(version: str, plugin_site: Path) -> None:
    bare = EngineHost(version, plugin_site, {})
    try:
        assert plugin_lines(bare.ready) == []
        answer = bare.start("plain", "qwen3-next-mtp-unmarked", env={"KVPLAN_MODE": "lease"})
        assert answer["ok"], answer
        assert plugin_lines(answer) == []
        # vLLM's own flags: 0.32's trailing-layer rule finds the MTP layer; 0.33+
        # flags only is_draft layers.
        assert [g["is_draft"] for g in answer["init"]["groups"]] == [
            False,
            False,
            version == "0.32",
        ]
        state = bare.send(op="wrapped")
        assert state["wrapped"] is False
        assert "kvplan.client.vllm_plugin.hooks" not in state["modules"]
    finally:
        bare.close()


def test_an_unsupported_release_disables_the_plugin(plugin_site: Path, server: Server) -> None:
    # vLLM 0.33's code under another version number: the gate reads the version.
    host = EngineHost(
        "0.33", plugin_site, {"KVPLAN_ADDR": server.addr, "KVPLAN_TEST_VLLM_VERSION": "0.35.0"}
    )
    try:
        (line,) = plugin_lines(host.ready)
        assert line == (
            "WARNING vllm.plugins.kvplan: [kvplan-plugin] kvplan plugin disabled: vLLM 0.35.0 "
            "is not a "
            "supported release (0.32.x, 0.33.x, 0.34.x)"
        )
        assert host.send(op="wrapped")["wrapped"] is False
        answer = host.start("plain", "llama")
        assert answer["ok"] and plugin_lines(answer) == []
    finally:
        host.close()
