"""Where the plugin meets vLLM's engine core: the version gate, the wrappers, the modes.

`vllm.v1.engine.core` imports `get_kv_cache_configs` (and, in 0.34,
`finalize_extensible_kv_cache`) by name; the plugin rebinds those names in that
module, and wraps `EngineCore._initialize_kv_caches` (to know which engine is
planning) and `EngineCore.shutdown` (to give its leases back). Where the engine's
global KV-cache groups come from is the release's (`Release.global_groups`): 0.33+
makes them in the engine core and passes them to `get_kv_cache_configs`; 0.32 makes
them inside it (`vllm.v1.core.kv_cache_utils.get_kv_cache_groups`, which the plugin
also wraps, to see them before they are projected onto each worker). vLLM's
grouping, tensor layout and attention backends stay vLLM's: the plugin changes at
most the draft flags of vLLM's own groups (draft-flags mode) and the memory figure
each worker plans with (lease mode).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import socket
import threading
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

import grpc

from kvplan.client.devices import DeviceResolutionError
from kvplan.client.errors import PlannerError
from kvplan.client.leases import LeaseKeeper
from kvplan.client.planner import PlannerClient
from kvplan.client.prefix_cache import (
    degraded_reason,
    repeated_prompts_only_reason,
    zero_hit_reason,
)
from kvplan.client.prefix_cache import summary as prefix_summary
from kvplan.client.vllm_plugin.engine import (
    UnsupportedSpec,
    WorkerDevice,
    compare,
    draft_flag_fix,
    gib,
    plan_request,
    vllm_groups,
)
from kvplan.client.vllm_plugin.fleet import FleetStart
from kvplan.client.vllm_plugin.logs import log
from kvplan.client.vllm_plugin.settings import Mode, Rules, Settings, Unavailable
from kvplan.client.vllm_plugin.worker import report_device
from kvplan.v1 import plan_pb2

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# kvplan answered, and the answer is that this engine cannot be planned as configured.
_REFUSALS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


class GlobalGroups(Enum):
    """Where an engine start's global KV-cache groups (the whole model's, draft flags
    set) come from, before vLLM projects them onto each worker."""

    # 0.33+: the engine core makes them (get_global_kv_cache_groups) and passes them
    # to get_kv_cache_configs.
    PASSED = "passed to get_kv_cache_configs"
    # 0.32: get_kv_cache_configs makes them itself, calling kv_cache_utils'
    # module-level get_kv_cache_groups (which also sets the draft flags).
    MADE_INSIDE = "made inside get_kv_cache_configs by kv_cache_utils.get_kv_cache_groups"


@dataclass(frozen=True)
class Release:
    """A vLLM release series the plugin supports, and what it wraps there."""

    series: str  # "0.33"
    engine_version: str  # the rule set kvplan is asked for (options.engine_version)
    global_groups: GlobalGroups
    extensible_kv_cache: bool  # 0.34: num_blocks is settled again after warm-up


RELEASES: dict[str, Release] = {
    "0.32": Release("0.32", "vllm-0.32", GlobalGroups.MADE_INSIDE, extensible_kv_cache=False),
    "0.33": Release("0.33", "vllm-0.33", GlobalGroups.PASSED, extensible_kv_cache=False),
    "0.34": Release("0.34", "vllm-0.34", GlobalGroups.PASSED, extensible_kv_cache=True),
}
# What the plugin wraps in vllm.v1.engine.core, with the parameters it relies on.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "EngineCore._initialize_kv_caches": ("self", "vllm_config"),
    "EngineCore.shutdown": ("self",),
    "get_kv_cache_configs": (
        "vllm_config",
        "kv_cache_specs",
        "available_memory",
        "global_kv_cache_groups",
    ),
}
EXTENSIBLE_SIGNATURES: dict[str, tuple[str, ...]] = {
    "finalize_extensible_kv_cache": (
        "vllm_config",
        "kv_cache_configs",
        "scheduler_kv_cache_config",
        "compilation_times",
    ),
}
# Where get_kv_cache_configs makes the groups itself (0.32): it takes no groups, and
# the plugin also wraps the function it makes them with, in vllm.v1.core.kv_cache_utils.
GROUPS_MADE_INSIDE_SIGNATURES: dict[str, tuple[str, ...]] = {
    "get_kv_cache_configs": ("vllm_config", "kv_cache_specs", "available_memory"),
}
KV_CACHE_UTILS_SIGNATURES: dict[str, tuple[str, ...]] = {
    "get_kv_cache_groups": ("vllm_config", "kv_cache_spec"),
}


def supported_series() -> str:
    """ "0.32.x, 0.33.x, 0.34.x": what the version gate's refusal names."""
    return ", ".join(f"{series}.x" for series in RELEASES)


def release_for(version: str) -> Release | None:
    parts = version.split(".")
    return RELEASES.get(".".join(parts[:2])) if len(parts) >= 2 else None


def _lookup(module: ModuleType, dotted: str) -> Any:
    target: Any = module
    for part in dotted.split("."):
        target = getattr(target, part)
    return target


def _signature_problems(
    module: ModuleType, wanted: dict[str, tuple[str, ...]], prefix: str = ""
) -> list[str]:
    problems: list[str] = []
    for dotted, params in wanted.items():
        try:
            target = _lookup(module, dotted)
        except AttributeError:
            problems.append(f"{prefix}{dotted} is missing")
            continue
        target = getattr(target, "__kvplan_original__", target)
        actual = tuple(inspect.signature(target).parameters)
        if actual != params:
            problems.append(f"{prefix}{dotted}{actual} != {params}")
    return problems


def signature_problems(
    module: ModuleType,
    release: Release,
    group_spec: type,
    kv_cache_utils: ModuleType | None = None,
) -> list[str]:
    """What differs from the signatures the plugin was written against ([] = none):
    `module` is vllm.v1.engine.core, `group_spec` vLLM's KVCacheGroupSpec, and
    `kv_cache_utils` vllm.v1.core.kv_cache_utils (read where the release makes its
    global groups inside get_kv_cache_configs)."""
    wanted = dict(SIGNATURES)
    if release.global_groups is GlobalGroups.MADE_INSIDE:
        wanted.update(GROUPS_MADE_INSIDE_SIGNATURES)
    if release.extensible_kv_cache:
        wanted.update(EXTENSIBLE_SIGNATURES)
    problems = _signature_problems(module, wanted)
    if release.global_groups is GlobalGroups.MADE_INSIDE:
        if kv_cache_utils is None:
            problems.append("vllm.v1.core.kv_cache_utils is missing")
        else:
            problems += _signature_problems(
                kv_cache_utils, KV_CACHE_UTILS_SIGNATURES, prefix="kv_cache_utils."
            )
    fields = getattr(group_spec, "__dataclass_fields__", {})
    for name in ("layer_names", "is_eagle_group"):
        if name not in fields:
            problems.append(f"KVCacheGroupSpec.{name} is missing")
    return problems


# --- counters ------------------------------------------------------------------------


@dataclass
class Counters:
    """What the plugin did in this process (also exported to Prometheus when vLLM's
    prometheus_client is importable)."""

    agreements: int = 0
    differences: int = 0
    fallbacks: int = 0  # kvplan unreachable, slow or failing: vLLM's own plan stood
    # kvplan refused the engine (INVALID_ARGUMENT, FAILED_PRECONDITION,
    # RESOURCE_EXHAUSTED) and so did vLLM: a misconfigured engine, not a fallback.
    refusals_agreed: int = 0
    draft_flag_changes: int = 0
    leases_granted: int = 0
    leases_refused: int = 0

    def add(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)
        metric = _metrics().get(name)
        if metric is not None:
            metric.inc()


COUNTERS = Counters()


@functools.cache
def _metrics() -> dict[str, Any]:
    try:
        from prometheus_client import Counter
    except ImportError:
        return {}
    try:
        return {
            name: Counter(f"kvplan_plugin_{name}", f"kvplan vLLM plugin: {name.replace('_', ' ')}")
            for name in Counters.__dataclass_fields__
        }
    except ValueError:  # already registered under these names in this process
        return {}


# --- one engine start ------------------------------------------------------------------


def _refusal(engine_id: str, addr: str, error: PlannerError) -> str:
    """What the operator reads when kvplan answers a lease request with an error:
    the status, the fields it names, and whether it is a refusal at all."""
    fields = "".join(f"; {v.field}: {v.description}" for v in error.violations if v.field)
    if error.code is grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"{addr} does not serve kvplan's PlanKVCache (UNIMPLEMENTED: {error.details}): "
            "not a kvplan server, or a version without it; check KVPLAN_ADDR"
        )
    return (
        f"kvplan refused the KV-cache lease of engine {engine_id} "
        f"({error.code_name}): {error.details}{fields}"
    )


# vLLM's get_kv_cache_configs for this engine start, given each worker's KV memory.
BuildConfigs = Callable[[list[int]], list[Any]]


class LeaseRefused(RuntimeError):
    """kvplan refused the engine's lease (or could not be asked, with
    KVPLAN_ON_UNAVAILABLE=refuse): the engine does not start."""


@dataclass(eq=False)  # held in a set by identity
class LeaseHold:
    engine_id: str
    client: PlannerClient
    keeper: LeaseKeeper
    footprints: dict[int, int]  # rank -> leased bytes
    cap_blocks: int = 0  # the block count the lease allows (settled by vLLM's planner)
    allocated: bool = False  # the KV cache exists: report the footprint as held
    released: bool = False

    def allocations(self) -> dict[int, int]:
        return dict(self.footprints) if self.allocated else {}

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        try:
            self.keeper.stop()  # releases, unless the leases are already gone
            if self.keeper.lost:
                log.info("kvplan lease: engine %s had no leases left to release", self.engine_id)
            else:
                log.info("kvplan lease: released the leases of engine %s", self.engine_id)
        except PlannerError as error:
            log.warning(
                "kvplan lease: releasing engine %s failed (%s); its leases expire after their TTL",
                self.engine_id,
                error,
            )
        finally:
            self.client.close()


def engine_id_for(configured: str, data_parallel_rank: int | None) -> str:
    """The id one engine core holds its leases under. Data-parallel cores start with
    one environment, so KVPLAN_ENGINE_ID alone would name them all, and each core's
    grant would replace another's leases: each gets its rank's suffix."""
    if not configured:
        return f"vllm-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return configured if data_parallel_rank is None else f"{configured}-dp{data_parallel_rank}"


def data_parallel_rank(vllm_config: Any) -> int | None:
    """This core's data-parallel rank, or None when the engine is one core."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if int(getattr(parallel, "data_parallel_size", 1) or 1) <= 1:
        return None
    return int(getattr(parallel, "data_parallel_rank", 0) or 0)


@dataclass
class EngineStart:
    """The plugin's part in one `EngineCore._initialize_kv_caches` call."""

    core: Any
    settings: Settings
    release: Release
    lease: LeaseHold | None = None
    engine_id: str = ""
    planned_blocks: int = 0  # what vLLM's planner gave (before 0.34's warm-up sizing)
    data_parallel_rank: int | None = None  # this core's, when the engine has several
    # 0.32: called with the global groups by the wrapped kv_cache_utils.get_kv_cache_groups,
    # while get_kv_cache_configs runs (see `build`).
    groups_hook: Callable[[list[Any]], None] | None = None
    measured: list[int] | None = None  # each worker's KV memory as vLLM measured it

    def __post_init__(self) -> None:
        self.engine_id = engine_id_for(self.settings.engine_id, self.data_parallel_rank)

    def rule_set_asked(self) -> str:
        """The rule set kvplan plans with: the running release's, except where
        kvplan's own rules are the point (draft-flags mode, KVPLAN_RULES=kvplan)."""
        if self.settings.mode is Mode.DRAFT_FLAGS or self.settings.rules is Rules.KVPLAN:
            return ""
        return self.release.engine_version

    def client(self) -> PlannerClient:
        return self.settings.planner_client()

    def supported_layouts(self) -> list[list[str]] | None:
        """Each worker's supported layouts, the lists the engine core resolved the
        layout from (one collective call); None when the executor cannot say."""
        getter = getattr(self.core.model_executor, "get_supported_kv_cache_layouts", None)
        if getter is None:
            return None
        try:
            return [[str(name) for name in names] for names in getter()]
        except Exception as error:  # the plan is still useful without them
            log.info("kvplan: workers' supported KV cache layouts unavailable (%s)", error)
            return None

    def fallback(self, why: str, error: BaseException) -> None:
        COUNTERS.add("fallbacks")
        log.warning(
            "kvplan %s: %s (%s); vLLM's own plan stands (fallback #%d)",
            self.settings.mode.value,
            why,
            error,
            COUNTERS.fallbacks,
        )

    def build(
        self,
        build_configs: BuildConfigs,
        memory: list[int],
        passed_groups: list[Any] | None,
        before_projection: Callable[[list[Any]], None] | None = None,
    ) -> tuple[list[Any], list[Any] | None]:
        """vLLM's per-worker configs for `memory`, and the global groups they were
        built from (None if they were never seen). `before_projection` gets those
        groups before vLLM projects them onto the workers and sizes the cache: before
        the call where the engine core passes them in (0.33+), or as
        kv_cache_utils.get_kv_cache_groups returns them inside the call (0.32)."""
        seen: list[list[Any]] = []

        def on_groups(groups: list[Any]) -> None:
            seen.append(groups)
            if before_projection is not None:
                before_projection(groups)

        if passed_groups is not None:
            on_groups(passed_groups)
            return build_configs(memory), passed_groups
        self.groups_hook = on_groups
        try:
            configs = build_configs(memory)
        finally:
            self.groups_hook = None
        return configs, seen[0] if seen else None

    def _noting_blocks(self, build_configs: BuildConfigs) -> BuildConfigs:
        """`build_configs`, remembering the block count vLLM's planner gave."""

        def build(memory: list[int]) -> list[Any]:
            configs = build_configs(memory)
            self.planned_blocks = int(configs[0].num_blocks) if configs else 0
            return configs

        return build

    def plan(
        self,
        build_configs: BuildConfigs,
        vllm_config: Any,
        kv_cache_specs: list[dict[str, Any]],
        available_memory: list[int],
        passed_groups: list[Any] | None,
    ) -> list[Any]:
        """The engine's configs, as vLLM builds them, with the mode's part around
        it. `passed_groups`: the global groups the engine core passed in (0.33+);
        None where get_kv_cache_configs makes them itself (0.32)."""
        build_configs = self._noting_blocks(build_configs)
        self.measured = [int(memory) for memory in available_memory]
        if self.settings.mode is Mode.LEASE:
            return self._lease(
                build_configs, vllm_config, kv_cache_specs, available_memory, passed_groups
            )
        try:
            request = plan_request(
                vllm_config,
                kv_cache_specs,
                available_memory,
                engine_version=self.rule_set_asked(),
                engine_id=self.engine_id,
                supported_layouts=self.supported_layouts(),
            )
            with self.client() as client:
                response = client.plan(request).response
        except UnsupportedSpec as error:
            self.fallback("this engine has a spec kvplan cannot represent", error)
            return build_configs(available_memory)
        except PlannerError as error:
            if error.code in _REFUSALS:
                return self._refused(build_configs, available_memory, error)
            self.fallback(f"kvplan at {self.settings.addr} did not answer with a plan", error)
            return build_configs(available_memory)
        except Exception as error:  # never let the plugin stop an engine in these modes
            self.fallback("the plugin failed", error)
            return build_configs(available_memory)
        fix = self._draft_flags_fixer(response) if self.settings.mode is Mode.DRAFT_FLAGS else None
        configs, global_groups = self.build(build_configs, available_memory, passed_groups, fix)
        self._report(global_groups, int(configs[0].num_blocks) if configs else None, response)
        return configs

    def _refused(
        self, build_configs: BuildConfigs, available_memory: list[int], error: PlannerError
    ) -> list[Any]:
        """kvplan refused the engine (observe, draft-flags): vLLM plans as always. If
        vLLM refuses it too, the two agree (counted apart from the fallbacks, so an
        alert on fallbacks does not fire for a misconfigured engine) and vLLM's
        error stops the start; if vLLM plans it, that is a difference."""
        refusal = f"{error.code_name}: {error.details}"
        try:
            configs = build_configs(available_memory)
        except Exception as vllm_error:
            COUNTERS.add("refusals_agreed")
            log.warning(
                "kvplan %s: kvplan and vLLM both refuse engine %s (kvplan %s; vLLM %s: %s); "
                "the engine's configuration needs a change (refusal agreement #%d)",
                self.settings.mode.value,
                self.engine_id,
                refusal,
                type(vllm_error).__name__,
                vllm_error,
                COUNTERS.refusals_agreed,
            )
            raise
        COUNTERS.add("differences")
        log.warning(
            "kvplan DIFFERENCE (kvplan refused engine %s, vLLM planned it): kvplan %s; "
            "vLLM's own plan stands",
            self.engine_id,
            refusal,
        )
        return configs

    def _draft_flags_fixer(self, response: plan_pb2.PlanResponse) -> Callable[[list[Any]], None]:
        def fix(global_groups: list[Any]) -> None:
            try:
                self._fix_draft_flags(global_groups, response)
            except Exception as error:  # vLLM's flags stand
                self.fallback("changing the draft flags failed", error)

        return fix

    def _report(
        self,
        global_groups: list[Any] | None,
        vllm_blocks: int | None,
        response: plan_pb2.PlanResponse,
    ) -> None:
        """The one observe line; never fails the engine's start."""
        if global_groups is None:  # get_kv_cache_groups was not called through the wrapper
            log.warning(
                "kvplan: vLLM's global KV-cache groups were not seen; cannot compare with plan %s",
                response.plan_id,
            )
            return
        try:
            comparison = compare(global_groups, vllm_blocks, response)
        except Exception as error:
            log.warning("kvplan: cannot compare with plan %s (%s)", response.plan_id, error)
            return
        if comparison.agrees:
            COUNTERS.add("agreements")
            log.info("%s", comparison.summary())
        else:
            COUNTERS.add("differences")
            log.warning("%s", comparison.summary())
        _log_prefix_cache(response, comparison.same_groups and comparison.same_flags)

    def _fix_draft_flags(self, global_groups: list[Any], response: plan_pb2.PlanResponse) -> None:
        wanted = draft_flag_fix(global_groups, response)
        if not wanted:
            return
        before = vllm_groups(global_groups)
        rules = {
            i: plan_pb2.DraftRule.Name(g.draft_rule).removeprefix("DRAFT_RULE_").lower()
            for i, g in enumerate(response.groups)
            if g.is_draft
        }
        for group, flag in zip(global_groups, wanted, strict=True):
            group.is_eagle_group = flag
        COUNTERS.add("draft_flag_changes")
        log.warning(
            "kvplan draft-flags: CHANGED vLLM's draft flags from %s to %s "
            "(kvplan's rules: %s), plan %s",
            "{" + ", ".join(str(i) for i, g in enumerate(before) if g.is_draft) + "}",
            "{" + ", ".join(str(i) for i, f in enumerate(wanted) if f) + "}",
            ", ".join(f"group {i}: {rule}" for i, rule in rules.items()),
            response.plan_id,
        )

    # --- lease mode ---------------------------------------------------------------------

    def _unavailable(
        self,
        why: str,
        error: BaseException,
        build_configs: BuildConfigs,
        available_memory: list[int],
    ) -> list[Any]:
        if self.settings.on_unavailable is Unavailable.SERVE:
            self.fallback(f"{why}; starting unleased (KVPLAN_ON_UNAVAILABLE=serve)", error)
            return build_configs(available_memory)
        COUNTERS.add("leases_refused")
        raise LeaseRefused(
            f"kvplan lease: {why} ({error}); the engine does not start without a lease "
            "(KVPLAN_ON_UNAVAILABLE=refuse; set it to 'serve' to start unleased)"
        ) from None

    def _lease(
        self,
        build_configs: BuildConfigs,
        vllm_config: Any,
        kv_cache_specs: list[dict[str, Any]],
        available_memory: list[int],
        passed_groups: list[Any] | None,
    ) -> list[Any]:
        engine_id = self.engine_id
        try:
            reports = self.core.model_executor.collective_rpc(report_device)
            devices = [WorkerDevice(**report) for report in reports]
            request = plan_request(
                vllm_config,
                kv_cache_specs,
                available_memory,
                engine_version=self.release.engine_version,
                engine_id=engine_id,
                devices=devices,
                supported_layouts=self.supported_layouts(),
            )
        except (UnsupportedSpec, DeviceResolutionError) as error:
            return self._unavailable(
                "cannot describe this engine to kvplan", error, build_configs, available_memory
            )
        except Exception as error:  # the plugin's own failure: the operator's choice too
            return self._unavailable("the plugin failed", error, build_configs, available_memory)
        client = self.client()
        try:
            result = client.plan(request)
        except PlannerError as error:
            client.close()
            if error.code in _UNREACHABLE:
                return self._unavailable(
                    f"kvplan at {self.settings.addr} is unreachable",
                    error,
                    build_configs,
                    available_memory,
                )
            COUNTERS.add("leases_refused")
            raise LeaseRefused(_refusal(engine_id, self.settings.addr, error)) from None
        response = result.response
        leased_kv = [int(w.budget.available_bytes) for w in response.workers]
        capped = [min(int(m), k) for m, k in zip(available_memory, leased_kv, strict=True)]
        footprints = {lease.rank: int(lease.bytes) for lease in response.leases}
        hold = LeaseHold(engine_id, client, keeper=None, footprints=footprints)  # type: ignore[arg-type]
        hold.keeper = LeaseKeeper(
            client, result, allocations=hold.allocations, on_lost=self._lost(engine_id)
        )
        hold.keeper.start()
        self.lease = hold
        _LIVE_LEASES.add(hold)
        COUNTERS.add("leases_granted")
        for rank, (measured_kv, kv) in enumerate(zip(available_memory, leased_kv, strict=True)):
            log.info(
                "kvplan lease: engine %s rank %d on %s: leased %s (KV %s); vLLM measured %s; "
                "KV cache gets %s; heartbeat every %.1f s, plan %s",
                engine_id,
                rank,
                devices[rank].uuid,
                gib(footprints.get(rank, 0)),
                gib(kv),
                gib(int(measured_kv)),
                gib(capped[rank]),
                hold.keeper.interval_s,
                response.plan_id,
            )
        configs, global_groups = self.build(build_configs, capped, passed_groups)
        hold.cap_blocks = int(configs[0].num_blocks) if configs else 0
        self._report(global_groups, hold.cap_blocks if capped == leased_kv else None, response)
        return configs

    def _lost(self, engine_id: str) -> Callable[[PlannerError], None]:
        def on_lost(error: PlannerError) -> None:
            log.error(
                "kvplan lease: the leases of engine %s are gone (%s); its memory may be "
                "granted to another engine: restart this engine to lease again",
                engine_id,
                error,
            )

        return on_lost


def _version() -> str:
    import vllm  # loaded already: vLLM is calling the plugin

    return str(getattr(vllm, "__version__", ""))


_LIVE_LEASES: set[LeaseHold] = set()
_current = threading.local()


def _release_all() -> None:
    for hold in list(_LIVE_LEASES):
        hold.release()
        _LIVE_LEASES.discard(hold)


atexit.register(_release_all)


# --- the wrappers ----------------------------------------------------------------------


def _wrap_initialize(original: Callable[..., Any], release: Release) -> Callable[..., Any]:
    @functools.wraps(original)
    def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
        settings = Settings.from_env()
        if not settings.enabled:
            return original(self, vllm_config)
        start = EngineStart(
            core=self,
            settings=settings,
            release=release,
            data_parallel_rank=data_parallel_rank(vllm_config),
        )
        fleet = FleetStart(self, start.client, start.engine_id, release.engine_version, _version())
        previous = getattr(_current, "start", None)
        _current.start = start
        try:
            with fleet.reusing(vllm_config) if settings.reuse_measurements else nullcontext():
                result = original(self, vllm_config)
        except BaseException:
            if start.lease is not None:  # the engine failed after the grant
                start.lease.release()
                _LIVE_LEASES.discard(start.lease)
            raise
        finally:
            _current.start = previous
        if start.lease is not None:
            start.lease.allocated = True
            self._kvplan_lease = start.lease
        fleet.report(vllm_config, start.measured)
        return result

    _initialize_kv_caches.__kvplan_original__ = original  # type: ignore[attr-defined]
    return _initialize_kv_caches


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            hold = getattr(self, "_kvplan_lease", None)
            if hold is not None:
                hold.release()
                _LIVE_LEASES.discard(hold)

    shutdown.__kvplan_original__ = original  # type: ignore[attr-defined]
    return shutdown


def _wrap_configs(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """0.33+: the engine core passes the global groups in."""

    @functools.wraps(original)
    def get_kv_cache_configs(
        vllm_config: Any,
        kv_cache_specs: list[dict[str, Any]],
        available_memory: list[int],
        global_kv_cache_groups: list[Any],
    ) -> list[Any]:
        start: EngineStart | None = getattr(_current, "start", None)
        if start is None:  # not called by an engine start: nothing to do
            return original(vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups)

        def build_configs(memory: list[int]) -> list[Any]:
            return original(vllm_config, kv_cache_specs, memory, global_kv_cache_groups)

        return start.plan(
            build_configs, vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups
        )

    get_kv_cache_configs.__kvplan_original__ = original  # type: ignore[attr-defined]
    return get_kv_cache_configs


def _wrap_configs_making_groups(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """0.32: get_kv_cache_configs makes the global groups itself (the wrapped
    kv_cache_utils.get_kv_cache_groups shows them to the engine start)."""

    @functools.wraps(original)
    def get_kv_cache_configs(
        vllm_config: Any,
        kv_cache_specs: list[dict[str, Any]],
        available_memory: list[int],
    ) -> list[Any]:
        start: EngineStart | None = getattr(_current, "start", None)
        if start is None:  # not called by an engine start: nothing to do
            return original(vllm_config, kv_cache_specs, available_memory)

        def build_configs(memory: list[int]) -> list[Any]:
            return original(vllm_config, kv_cache_specs, memory)

        return start.plan(build_configs, vllm_config, kv_cache_specs, available_memory, None)

    get_kv_cache_configs.__kvplan_original__ = original  # type: ignore[attr-defined]
    return get_kv_cache_configs


def _wrap_groups(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """0.32's kv_cache_utils.get_kv_cache_groups: the groups it makes for the whole
    model inside get_kv_cache_configs go to the engine start's hook, after vLLM set
    their draft flags and before they are projected onto the workers. Every other
    call (a worker's own grouping, a memory check) passes through."""

    @functools.wraps(original)
    def get_kv_cache_groups(vllm_config: Any, kv_cache_spec: dict[str, Any]) -> list[Any]:
        start: EngineStart | None = getattr(_current, "start", None)
        hook = start.groups_hook if start is not None else None
        if start is not None and hook is not None:
            # Taken by the outermost call: HiSparse groups its other layers through
            # this function again, from inside it.
            start.groups_hook = None
        groups = original(vllm_config, kv_cache_spec)
        if hook is not None:
            hook(groups)
        return groups

    get_kv_cache_groups.__kvplan_original__ = original  # type: ignore[attr-defined]
    return get_kv_cache_groups


def _wrap_finalize(original: Callable[..., int]) -> Callable[..., int]:
    @functools.wraps(original)
    def finalize_extensible_kv_cache(
        vllm_config: Any,
        kv_cache_configs: list[Any],
        scheduler_kv_cache_config: Any,
        compilation_times: list[Any],
    ) -> int:
        num_blocks = original(
            vllm_config, kv_cache_configs, scheduler_kv_cache_config, compilation_times
        )
        start: EngineStart | None = getattr(_current, "start", None)
        if start is not None and start.lease is None:
            log.info(
                "kvplan %s: extensible KV cache settled at %d blocks after warm-up "
                "(planned capacity %d)",
                start.settings.mode.value,
                num_blocks,
                start.planned_blocks,
            )
        if start is not None and start.lease is not None:
            # vLLM settles on min(measured after warm-up, the reserved capacity);
            # the reservation was planned from the leased bytes, so it is the cap.
            log.info(
                "kvplan lease: extensible KV cache settled at %d blocks (lease cap %d blocks)",
                num_blocks,
                start.lease.cap_blocks,
            )
            if num_blocks > start.lease.cap_blocks:
                raise LeaseRefused(
                    f"kvplan lease: vLLM settled on {num_blocks} blocks, more than the "
                    f"{start.lease.cap_blocks} the lease allows"
                )
        return num_blocks

    finalize_extensible_kv_cache.__kvplan_original__ = original  # type: ignore[attr-defined]
    return finalize_extensible_kv_cache


def install(
    core_module: ModuleType, release: Release, kv_cache_utils: ModuleType | None = None
) -> None:
    """Wrap what the plugin needs in vllm.v1.engine.core, and where the release makes
    its global groups inside get_kv_cache_configs (0.32), the function in
    `kv_cache_utils` (vllm.v1.core.kv_cache_utils) it makes them with (idempotent)."""
    engine_core = core_module.EngineCore
    if getattr(engine_core._initialize_kv_caches, "__kvplan_original__", None) is not None:
        return
    engine_core._initialize_kv_caches = _wrap_initialize(engine_core._initialize_kv_caches, release)
    engine_core.shutdown = _wrap_shutdown(engine_core.shutdown)
    if release.global_groups is GlobalGroups.MADE_INSIDE:
        if kv_cache_utils is None:
            raise ValueError(f"vLLM {release.series} needs vllm.v1.core.kv_cache_utils")
        core_module.get_kv_cache_configs = _wrap_configs_making_groups(  # type: ignore[attr-defined]
            core_module.get_kv_cache_configs
        )
        kv_cache_utils.get_kv_cache_groups = _wrap_groups(  # type: ignore[attr-defined]
            kv_cache_utils.get_kv_cache_groups
        )
    else:
        core_module.get_kv_cache_configs = _wrap_configs(core_module.get_kv_cache_configs)  # type: ignore[attr-defined]
    if release.extensible_kv_cache:
        core_module.finalize_extensible_kv_cache = _wrap_finalize(  # type: ignore[attr-defined]
            core_module.finalize_extensible_kv_cache
        )


def _log_prefix_cache(response: plan_pb2.PlanResponse, vllms_own: bool) -> None:
    """Observe's prefix-cache line: what the plan predicts, and a warning when the
    engine will get no hit, fewer for an unidentified drafter, or none for shared
    prefixes shorter than a stored prompt (only repeated prompts hit). `vllms_own`:
    vLLM's groups and draft flags are the plan's, so the prediction is vLLM's."""
    if not response.diagnostics.HasField("prefix_cache"):
        return  # an older server
    whose = "vLLM's own setup" if vllms_own else "kvplan's draft flags (vLLM's differ)"
    zero, fewer = zero_hit_reason(response), degraded_reason(response)
    repeated_only = repeated_prompts_only_reason(response)
    if zero or fewer or repeated_only:
        label = "ZERO HITS" if zero else "FEWER HITS" if fewer else "ZERO SHARED-PREFIX HITS"
        log.warning(
            "kvplan prefix cache: %s expected for %s: %s; plan %s",
            label,
            whose,
            zero or "; and ".join(r for r in (fewer, repeated_only) if r),
            response.plan_id,
        )
    else:
        log.info("kvplan %s (%s), plan %s", prefix_summary(response.diagnostics.prefix_cache),
                 whose, response.plan_id)  # fmt: skip
