"""The plugin's pure parts, without vLLM: settings, the comparison line, the draft-flag
decision, and the version table."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import grpc
import pytest

from kvplan.client.errors import PlannerError, Violation
from kvplan.client.vllm_plugin import hooks, register
from kvplan.client.vllm_plugin.engine import compare, draft_flag_fix, spec_decode
from kvplan.client.vllm_plugin.hooks import (
    EngineStart,
    GlobalGroups,
    _refusal,
    data_parallel_rank,
    engine_id_for,
    release_for,
    signature_problems,
    supported_series,
)
from kvplan.client.vllm_plugin.settings import Mode, Settings, SettingsError, Unavailable
from kvplan.client.vllm_plugin.specs import UnsupportedSpec
from kvplan.v1 import plan_pb2


def test_settings_defaults_and_values() -> None:
    assert not Settings.from_env({}).enabled
    settings = Settings.from_env(
        {
            "KVPLAN_ADDR": " kvplan:50051 ",
            "KVPLAN_MODE": "LEASE",
            "KVPLAN_TIMEOUT_S": "0.5",
            "KVPLAN_ON_UNAVAILABLE": "serve",
            "KVPLAN_ENGINE_ID": "chat",
        }
    )
    assert settings.addr == "kvplan:50051" and settings.enabled
    assert settings.mode is Mode.LEASE and settings.timeout_s == 0.5
    assert settings.on_unavailable is Unavailable.SERVE and settings.engine_id == "chat"
    assert Settings.from_env({"KVPLAN_ADDR": "x:1"}).mode is Mode.OBSERVE
    assert settings.security.token is None and not settings.security.tls


def test_settings_reuse_measurements_only_where_the_mode_may_change_memory() -> None:
    base = {"KVPLAN_ADDR": "x:1"}
    assert not Settings.from_env(base).reuse_measurements
    for mode in ("draft-flags", "lease"):
        for value in ("1", "true", "ON"):
            env = {**base, "KVPLAN_MODE": mode, "KVPLAN_REUSE_MEASUREMENTS": value}
            assert Settings.from_env(env).reuse_measurements
        env = {**base, "KVPLAN_MODE": mode, "KVPLAN_REUSE_MEASUREMENTS": "0"}
        assert not Settings.from_env(env).reuse_measurements
    with pytest.raises(SettingsError, match="observe mode never does"):
        Settings.from_env({**base, "KVPLAN_REUSE_MEASUREMENTS": "1"})
    with pytest.raises(SettingsError, match="KVPLAN_REUSE_MEASUREMENTS='maybe'"):
        Settings.from_env({**base, "KVPLAN_MODE": "lease", "KVPLAN_REUSE_MEASUREMENTS": "maybe"})


def test_settings_carry_the_clients_tls_and_token(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    settings = Settings.from_env(
        {"KVPLAN_ADDR": "x:1", "KVPLAN_TOKEN": "engine-token", "KVPLAN_TLS_CA": str(ca)}
    )
    assert settings.security.token == "engine-token"
    assert settings.security.tls and settings.security.root_certificates == ca.read_bytes()
    with pytest.raises(SettingsError, match="TLS/token"):
        Settings.from_env({"KVPLAN_ADDR": "x:1", "KVPLAN_TLS_CA": str(tmp_path / "missing")})
    # An unreadable file is named by the variable that named it.
    for name in (
        "KVPLAN_TLS_CA",
        "KVPLAN_CLIENT_KEY",
        "KVPLAN_CLIENT_CERT",
        "KVPLAN_CLIENT_TOKEN_FILE",
    ):
        missing = str(tmp_path / "missing")
        with pytest.raises(SettingsError, match=f"{name}={missing}: No such file"):
            Settings.from_env({"KVPLAN_ADDR": "x:1", name: missing})


def test_spec_decode_maps_ngram_on_the_gpu_as_ngram() -> None:
    for method in ("ngram", "ngram_gpu"):
        config = SimpleNamespace(
            speculative_config=SimpleNamespace(method=method, num_speculative_tokens=3)
        )
        spec = spec_decode(config)
        assert spec.method == plan_pb2.SPEC_DECODE_METHOD_NGRAM
        assert spec.num_speculative_tokens == 3
    unknown = SimpleNamespace(speculative_config=SimpleNamespace(method="telepathy"))
    with pytest.raises(UnsupportedSpec, match="'telepathy' has no kvplan SpecDecodeMethod"):
        spec_decode(unknown)


def test_a_lease_error_names_its_status_and_fields() -> None:
    refused = PlannerError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "GPU-1: 72.0 GiB asked, 8.0 GiB left",
        (Violation("workers[0].device.uuid", "72.0 GiB asked"),),
    )
    message = _refusal("chat", "kvplan:50051", refused)
    assert message == (
        "kvplan refused the KV-cache lease of engine chat (RESOURCE_EXHAUSTED): "
        "GPU-1: 72.0 GiB asked, 8.0 GiB left; workers[0].device.uuid: 72.0 GiB asked"
    )
    not_kvplan = PlannerError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    message = _refusal("chat", "kvplan:50051", not_kvplan)
    assert message.startswith("kvplan:50051 does not serve kvplan's PlanKVCache (UNIMPLEMENTED")
    assert "check KVPLAN_ADDR" in message


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("KVPLAN_MODE", "leese", "KVPLAN_MODE='leese'"),
        ("KVPLAN_TIMEOUT_S", "0", "KVPLAN_TIMEOUT_S='0'"),
        ("KVPLAN_TIMEOUT_S", "soon", "seconds > 0"),
        ("KVPLAN_ON_UNAVAILABLE", "maybe", "refuse or serve"),
        ("KVPLAN_RULES", "mine", "engine or kvplan"),
    ],
)
def test_settings_refuse_what_they_cannot_read(name: str, value: str, needle: str) -> None:
    with pytest.raises(SettingsError, match=needle.replace("(", r"\(")):
        Settings.from_env({"KVPLAN_ADDR": "x:1", name: value})


def test_register_is_inert_without_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPLAN_ADDR", raising=False)
    before = set(sys.modules)
    register()
    assert not {m for m in set(sys.modules) - before if m.startswith(("vllm", "kvplan"))}


def test_supported_releases() -> None:
    assert release_for("0.33.0") is not None and release_for("0.33.2rc1") is not None
    release = release_for("0.34.1")
    assert release is not None and release.extensible_kv_cache
    assert release.engine_version == "vllm-0.34"
    assert release.global_groups is GlobalGroups.PASSED
    old = release_for("0.32.3")
    assert old is not None and old.engine_version == "vllm-0.32"
    assert old.global_groups is GlobalGroups.MADE_INSIDE and not old.extensible_kv_cache
    assert supported_series() == "0.32.x, 0.33.x, 0.34.x"
    for other in ("0.31.0", "0.35.0", "1.0.0", "dev"):
        assert release_for(other) is None


def _response(flags: list[bool], num_blocks: int = 100) -> plan_pb2.PlanResponse:
    response = plan_pb2.PlanResponse(plan_id="plan-1", num_blocks=num_blocks)
    for i, flag in enumerate(flags):
        response.groups.add(
            group_id=i,
            layer_names=[f"l{i}"],
            is_draft=flag,
            draft_rule=plan_pb2.DRAFT_RULE_TRAILING_LAYER if flag else plan_pb2.DRAFT_RULE_NONE,
        )
    return response


def _vllm_groups(flags: list[bool]) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(layer_names=[f"l{i}"], is_eagle_group=flag) for i, flag in enumerate(flags)
    ]


def test_comparison_names_each_difference() -> None:
    same = compare(_vllm_groups([False, True]), 100, _response([False, True]))
    assert same.agrees
    assert same.summary().startswith("kvplan agreement, rule set kvplan, 2 groups")
    assert "draft groups {1 (trailing_layer)}" in same.summary()
    flags = compare(_vllm_groups([False, False]), 90, _response([False, True]))
    assert flags.differences() == [
        "draft flags: vLLM {} kvplan {1 (trailing_layer)}",
        "num_blocks: vLLM 90 kvplan 100",
    ]
    regrouped = compare(
        [SimpleNamespace(layer_names=["l0", "l1"], is_eagle_group=False)],
        100,
        _response([False, False]),
    )
    assert regrouped.differences() == ["groups: vLLM [[l0, l1]] kvplan [[l0]; [l1]]"]
    assert "DIFFERENCE (groups:" in regrouped.summary()


def test_flag_all_warning_is_in_the_line() -> None:
    response = _response([False, False])
    response.diagnostics.warnings.add(
        code=plan_pb2.WARNING_CODE_NO_DRAFT_GROUP_MAMBA, message="consumers flag every group"
    )
    line = compare(_vllm_groups([False, False]), 100, response).summary()
    assert "warning: consumers flag every group" in line


def test_draft_flag_fix_only_where_vllm_flagged_none_or_all() -> None:
    assert draft_flag_fix(_vllm_groups([False, False]), _response([False, True])) == [False, True]
    assert draft_flag_fix(_vllm_groups([True, True]), _response([False, True])) == [False, True]
    # vLLM's own partial flags stand; kvplan flagging nothing or all changes nothing.
    assert draft_flag_fix(_vllm_groups([True, False]), _response([False, True])) == []
    assert draft_flag_fix(_vllm_groups([False, False]), _response([False, False])) == []
    assert draft_flag_fix(_vllm_groups([False, False]), _response([True, True])) == []
    # Different groups: nothing to map the flags onto.
    other = [SimpleNamespace(layer_names=["x"], is_eagle_group=False)] * 2
    assert draft_flag_fix(other, _response([False, True])) == []


def test_the_gate_names_every_signature_it_does_not_recognise() -> None:
    import dataclasses

    @dataclasses.dataclass
    class GroupSpec:
        layer_names: list[str]
        is_eagle_group: bool = False

    class EngineCore:
        def _initialize_kv_caches(self, vllm_config: object) -> None: ...

        def shutdown(self) -> None: ...

    def get_kv_cache_configs(
        vllm_config: object,
        kv_cache_specs: object,
        available_memory: object,
        global_kv_cache_groups: object,
    ) -> None: ...

    def finalize_extensible_kv_cache(vllm_config: object, kv_cache_configs: object) -> None: ...

    module = ModuleType("core")
    module.EngineCore = EngineCore  # type: ignore[attr-defined]
    module.get_kv_cache_configs = get_kv_cache_configs  # type: ignore[attr-defined]
    release_33 = release_for("0.33.0")
    release_34 = release_for("0.34.0")
    assert release_33 is not None and release_34 is not None
    assert signature_problems(module, release_33, GroupSpec) == []
    problems = signature_problems(module, release_34, GroupSpec)
    assert problems == ["finalize_extensible_kv_cache is missing"]
    module.finalize_extensible_kv_cache = finalize_extensible_kv_cache  # type: ignore[attr-defined]
    (problem,) = signature_problems(module, release_34, GroupSpec)
    assert problem.startswith("finalize_extensible_kv_cache('vllm_config', 'kv_cache_configs')")

    @dataclasses.dataclass
    class OldGroupSpec:
        layer_names: list[str]

    assert signature_problems(module, release_33, OldGroupSpec) == [
        "KVCacheGroupSpec.is_eagle_group is missing"
    ]

    # 0.32: get_kv_cache_configs makes the groups itself, with kv_cache_utils'
    # get_kv_cache_groups, which the plugin wraps too.
    def get_kv_cache_configs_032(
        vllm_config: object, kv_cache_specs: object, available_memory: object
    ) -> None: ...

    def get_kv_cache_groups(vllm_config: object, kv_cache_spec: object) -> None: ...

    release_32 = release_for("0.32.0")
    assert release_32 is not None
    assert signature_problems(module, release_32, GroupSpec) == [
        "get_kv_cache_configs('vllm_config', 'kv_cache_specs', 'available_memory', "
        "'global_kv_cache_groups') != ('vllm_config', 'kv_cache_specs', 'available_memory')",
        "vllm.v1.core.kv_cache_utils is missing",
    ]
    module.get_kv_cache_configs = get_kv_cache_configs_032  # type: ignore[attr-defined]
    kv_cache_utils = ModuleType("kv_cache_utils")
    assert signature_problems(module, release_32, GroupSpec, kv_cache_utils) == [
        "kv_cache_utils.get_kv_cache_groups is missing"
    ]
    kv_cache_utils.get_kv_cache_groups = get_kv_cache_groups  # type: ignore[attr-defined]
    assert signature_problems(module, release_32, GroupSpec, kv_cache_utils) == []
    # The 0.33 table on 0.32's code: the groups parameter is missing.
    (problem,) = signature_problems(module, release_33, GroupSpec, kv_cache_utils)
    assert problem.endswith("'available_memory', 'global_kv_cache_groups')")


def test_only_the_grouping_of_the_whole_model_reaches_the_engine_start() -> None:
    """0.32: get_kv_cache_configs makes the global groups with kv_cache_utils'
    get_kv_cache_groups; the wrapper hands the outermost call's groups to the
    engine start (before projection), and every other call passes through."""

    def get_kv_cache_groups(vllm_config: object, kv_cache_spec: str) -> list[str]:
        if kv_cache_spec == "model":  # as HiSparse groups its other layers, from inside
            wrapped(vllm_config, "nested")
        return [kv_cache_spec]

    wrapped = hooks._wrap_groups(get_kv_cache_groups)
    release = release_for("0.32.0")
    assert release is not None
    start = EngineStart(core=None, settings=Settings(addr="kvplan:1"), release=release)

    def build_configs(memory: list[int]) -> list[SimpleNamespace]:
        wrapped(None, "model")
        wrapped(None, "check")  # a later grouping (a memory check) is not the model's
        return [SimpleNamespace(num_blocks=memory[0])]

    seen: list[list[str]] = []
    hooks._current.start = start
    try:
        assert wrapped(None, "worker") == ["worker"]  # outside get_kv_cache_configs
        configs, groups = start.build(build_configs, [7], None, seen.append)
        assert groups == ["model"] and seen == [["model"]]
        assert configs[0].num_blocks == 7 and start.groups_hook is None
        # Grouping that never went through the wrapper: nothing to compare with.
        configs, groups = start.build(lambda memory: [], [7], None)
        assert groups is None
        # 0.33+: the engine core passed the groups in; they are seen before the call.
        order: list[object] = []

        def build_after_flags(memory: list[int]) -> list[SimpleNamespace]:
            order.append("configs")
            return []

        configs, groups = start.build(build_after_flags, [7], ["passed"], order.append)
        assert groups == ["passed"] and order == [["passed"], "configs"]
    finally:
        hooks._current.start = None


def test_the_plugin_imports_only_the_thin_clients_dependencies() -> None:
    """Module level: the standard library, grpcio, protobuf and kvplan's client and
    stubs. vllm is imported only inside `register`, when vLLM calls it."""
    import ast
    from pathlib import Path

    import kvplan.client.vllm_plugin as plugin

    allowed = ("grpc", "google.protobuf", "kvplan.client", "kvplan.v1")
    for path in Path(plugin.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or name.startswith(allowed), (path, name)
        inner = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in (node.names if isinstance(node, ast.Import) else [])
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        assert "torch" not in inner, path


def test_data_parallel_cores_hold_leases_under_ids_of_their_own() -> None:
    def config(size: int, rank: int) -> SimpleNamespace:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_size=size, data_parallel_rank=rank)
        )

    assert data_parallel_rank(config(1, 0)) is None
    assert data_parallel_rank(SimpleNamespace()) is None
    ranks = [data_parallel_rank(config(4, rank)) for rank in range(4)]
    assert [engine_id_for("chat", rank) for rank in ranks] == [
        "chat-dp0",
        "chat-dp1",
        "chat-dp2",
        "chat-dp3",
    ]
    assert engine_id_for("chat", None) == "chat"
    generated = {engine_id_for("", None) for _ in range(3)}
    assert len(generated) == 3 and all(name.startswith("vllm-") for name in generated)


def test_loading_the_entry_point_imports_neither_grpc_nor_protobuf() -> None:
    """vLLM loads the entry point in every process, KVPLAN_ADDR set or not."""
    code = (
        "import sys, kvplan.client.vllm_plugin as plugin; plugin.register(); "
        "print(sorted(m for m in sys.modules if m.startswith(('grpc', 'google', 'kvplan'))))"
    )
    env = {key: value for key, value in os.environ.items() if key != "KVPLAN_ADDR"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['kvplan', 'kvplan.client', 'kvplan.client.vllm_plugin']"


@pytest.mark.parametrize(
    ("mode", "on_unavailable", "stops"),
    [
        ("lease", "", True),
        ("lease", "refuse", True),
        ("lease", "serve", False),
        ("observe", "", False),
    ],
)
def test_a_plugin_that_cannot_load_stops_only_an_engine_that_needs_its_lease(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    on_unavailable: str,
    stops: bool,
) -> None:
    monkeypatch.setenv("KVPLAN_ADDR", "kvplan:50051")
    monkeypatch.setenv("KVPLAN_MODE", mode)
    monkeypatch.setenv("KVPLAN_ON_UNAVAILABLE", on_unavailable)
    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))
    # As an environment whose protobuf is older than the stubs: the hooks do not import.
    monkeypatch.setitem(sys.modules, "kvplan.client.vllm_plugin.hooks", None)
    if stops:
        with pytest.raises(RuntimeError, match="does not start without a lease"):
            register()
        return
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvplan"):
        register()
    assert "the kvplan plugin cannot load" in caplog.text
    assert "vLLM plans alone" in caplog.text


def test_plugin_records_carry_the_tag_and_the_callers_file(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's default format prints [file:line], not the logger's name: every record
    starts with the tag operators grep for, and names the caller's file (the
    adapter adds no frame of its own)."""
    from kvplan.client.vllm_plugin.logs import LOG_TAG, LOGGER_NAME, log

    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        log.warning("kvplan %s: %s", "observe", "something")
    (record,) = caplog.records
    assert record.getMessage() == f"{LOG_TAG} kvplan observe: something"
    assert record.name == LOGGER_NAME
    assert record.filename == Path(__file__).name


def test_zero_hits_only_where_no_prefix_hits_an_unidentified_drafter_is_fewer() -> None:
    from kvplan.cli import load_request
    from kvplan.client.prefix_cache import degraded_reason, zero_hit_reason
    from kvplan.convert import plan_from_proto

    example = Path(__file__).resolve().parents[2] / "examples" / "qwen3-next-80b-a3b-mtp.yaml"
    request = load_request(str(example))
    request.options.engine_version = "vllm-0.32"
    assert zero_hit_reason(plan_from_proto(request)) == ""
    # EAGLE with no drafter layer marked: nothing identifies the draft group, every
    # group takes 0.32's drop.
    request.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_EAGLE
    unmarked = plan_from_proto(request)
    assert not any(g.is_draft for g in unmarked.groups)
    # Every group drops, yet a long enough shared prefix still hits (the core).
    assert zero_hit_reason(unmarked) == "" and "is_draft" in degraded_reason(unmarked)
    request.options.max_model_len = unmarked.diagnostics.prefix_cache.min_shared_prefix_tokens - 1
    assert "longer than max_model_len" in zero_hit_reason(plan_from_proto(request))
    request.options.enable_prefix_caching = False
    assert zero_hit_reason(plan_from_proto(request)) == ""  # off on purpose


def test_observe_warns_of_an_unidentified_drafter_with_the_knob(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvplan.cli import load_request
    from kvplan.convert import plan_from_proto

    example = Path(__file__).resolve().parents[2] / "examples" / "qwen3-next-80b-a3b-mtp.yaml"
    request = load_request(str(example))
    request.options.engine_version = "vllm-0.32"
    request.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_EAGLE
    with caplog.at_level(logging.INFO, logger="vllm.plugins.kvplan"):
        hooks._log_prefix_cache(plan_from_proto(request), vllms_own=True)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "[kvplan-plugin] kvplan prefix cache: FEWER HITS expected for vLLM's own setup: "
    )
    assert "is_draft" in record.getMessage()
