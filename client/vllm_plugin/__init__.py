"""kvplan inside vLLM: a `vllm.general_plugins` entry point (`register`).

Inert unless KVPLAN_ADDR is set. Then, in vLLM 0.32.x, 0.33.x and 0.34.x only
(checked, with the signatures of everything it wraps, when vLLM loads it), every
engine start asks kvplan for its KV-cache plan:

- KVPLAN_MODE=observe (default): vLLM plans as always; one log line says whether
  kvplan agrees, or the exact difference.
- KVPLAN_MODE=draft-flags: as observe, and where kvplan's draft rules identify the
  drafter's group and vLLM flagged none (or all), vLLM's flags become kvplan's.
- KVPLAN_MODE=lease: each worker's KV memory is min(vLLM's measurement, kvplan's
  lease on its GPU); a heartbeat keeps the lease, shutdown releases it.

See docs/vllm.md. This package imports vllm only when vLLM calls `register`, and
needs nothing beyond grpcio and protobuf.
"""

from __future__ import annotations

import importlib
import os


def register() -> None:
    """The entry point vLLM calls in each of its processes (more than once is fine)."""
    if not os.environ.get("KVPLAN_ADDR", "").strip():
        return  # inert: nothing imported, nothing wrapped
    from kvplan.client.vllm_plugin.logs import log

    try:
        import vllm
    except ImportError:  # not inside vLLM
        return
    try:
        from kvplan.client.vllm_plugin.hooks import (
            GlobalGroups,
            install,
            release_for,
            signature_problems,
            supported_series,
        )
    except Exception as error:  # grpcio missing, a protobuf older than the stubs, ...
        _cannot_load(error)
        return

    version = str(getattr(vllm, "__version__", "unknown"))
    release = release_for(version)
    if release is None:
        log.warning(
            "kvplan plugin disabled: vLLM %s is not a supported release (%s)",
            version,
            supported_series(),
        )
        return
    try:
        import vllm.v1.engine.core as core_module
    except Exception as error:  # a vLLM build without the v1 engine core
        log.warning("kvplan plugin disabled: cannot import vllm.v1.engine.core (%s)", error)
        return
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    kv_cache_utils = None
    if release.global_groups is GlobalGroups.MADE_INSIDE:  # 0.32: groups made in there
        kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")

    problems = signature_problems(core_module, release, KVCacheGroupSpec, kv_cache_utils)
    if problems:
        log.warning(
            "kvplan plugin disabled: vLLM %s differs from what the plugin wraps: %s",
            version,
            "; ".join(problems),
        )
        return
    install(core_module, release, kv_cache_utils)
    log.info(
        "kvplan plugin active for vLLM %s (KVPLAN_ADDR=%s, KVPLAN_MODE=%s)",
        version,
        os.environ["KVPLAN_ADDR"],
        os.environ.get("KVPLAN_MODE", "observe"),
    )


def _cannot_load(error: Exception) -> None:
    """The plugin's own modules do not import in this environment. An engine that must
    hold a lease (KVPLAN_MODE=lease, KVPLAN_ON_UNAVAILABLE=refuse, the default) must
    not start without one: vLLM calls `register` outside its guard, so raising stops
    the start. Otherwise vLLM plans alone, as when kvplan is unreachable."""
    reason = (
        f"the kvplan plugin cannot load ({type(error).__name__}: {error}); it needs "
        "grpcio and protobuf as kvplan's package requires (pip install kvplan)"
    )
    # Read here, not through Settings: it imports the client (grpc), which may be
    # what failed to import.
    mode = os.environ.get("KVPLAN_MODE", "").strip().lower()
    on_unavailable = os.environ.get("KVPLAN_ON_UNAVAILABLE", "").strip().lower() or "refuse"
    if mode == "lease" and on_unavailable == "refuse":
        raise RuntimeError(
            f"{reason}; the engine does not start without a lease (KVPLAN_ON_UNAVAILABLE=serve "
            "starts it unleased)"
        ) from error
    from kvplan.client.vllm_plugin.logs import log

    log.warning("%s; vLLM plans alone", reason)


__all__ = ["register"]
