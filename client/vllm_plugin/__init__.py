"""kvplan inside vLLM: a `vllm.general_plugins` entry point (`register`).

Inert unless KVPLAN_ADDR is set. Then, in vLLM 0.33.x and 0.34.x only (checked,
with the signatures of everything it wraps, when vLLM loads it), every engine
start asks kvplan for its KV-cache plan:

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

import logging
import os

log = logging.getLogger("vllm.plugins.kvplan")


def register() -> None:
    """The entry point vLLM calls in each of its processes (more than once is fine)."""
    if not os.environ.get("KVPLAN_ADDR", "").strip():
        return  # inert: nothing imported, nothing wrapped
    try:
        import vllm
    except ImportError:  # not inside vLLM
        return
    from kvplan.client.vllm_plugin.hooks import install, release_for, signature_problems

    version = str(getattr(vllm, "__version__", "unknown"))
    release = release_for(version)
    if release is None:
        log.warning(
            "kvplan plugin disabled: vLLM %s is not a supported release (0.33.x, 0.34.x)",
            version,
        )
        return
    try:
        import vllm.v1.engine.core as core_module
    except Exception as error:  # a vLLM build without the v1 engine core
        log.warning("kvplan plugin disabled: cannot import vllm.v1.engine.core (%s)", error)
        return
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    problems = signature_problems(core_module, release, KVCacheGroupSpec)
    if problems:
        log.warning(
            "kvplan plugin disabled: vLLM %s differs from what the plugin wraps: %s",
            version,
            "; ".join(problems),
        )
        return
    install(core_module, release)
    log.info(
        "kvplan plugin active for vLLM %s (KVPLAN_ADDR=%s, KVPLAN_MODE=%s)",
        version,
        os.environ["KVPLAN_ADDR"],
        os.environ.get("KVPLAN_MODE", "observe"),
    )


__all__ = ["register"]
