"""vLLM 0.33's own planning, timed in its own process for bench.vs_vllm.

Runs inside vLLM's environment with the repository on PYTHONPATH:

    ~/.cache/kvplan/vllm-0.33/venv/bin/python -m bench.vllm_worker

Reads one job per line on stdin, {"request": PATH, "seconds": S, "min_calls": N}
(PATH: a serialized PlanRequest), and answers one line on stdout, prefixed with
REPLY_PREFIX: {"samples_s": [...]} or {"error": "..."}. Each sample is one planning of
the engine as vLLM's engine core does it, get_global_kv_cache_groups then
get_kv_cache_configs, on inputs built fresh for the sample (vLLM mutates its config)
by kvplan's conformance driver; building the inputs is not timed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

READY_LINE = "KVPLAN-BENCH-VLLM-READY"
REPLY_PREFIX = "KVPLAN-BENCH-VLLM "


def main() -> int:
    # vLLM logs on stdout too: replies carry a prefix the parent looks for.
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    from conformance import vllm_driver
    from kvplan.gpus import GPU_MEMORY_BYTES
    from kvplan.v1 import plan_pb2

    print(READY_LINE, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        request = plan_pb2.PlanRequest.FromString(Path(job["request"]).read_bytes())
        samples: list[float] = []
        try:
            deadline = time.perf_counter() + float(job["seconds"])
            while time.perf_counter() < deadline or len(samples) < int(job["min_calls"]):
                # Device names resolve with kvplan's table: an input, as in conformance.
                inputs = vllm_driver.build_inputs(request, GPU_MEMORY_BYTES)
                register_all_kvcache_specs(inputs.config)
                start = time.perf_counter()
                groups = get_global_kv_cache_groups(inputs.config, inputs.specs)
                get_kv_cache_configs(inputs.config, inputs.specs, inputs.available_memory, groups)
                samples.append(time.perf_counter() - start)
            reply: dict[str, object] = {"samples_s": samples}
        except Exception as error:  # reported to the parent, which fails the target
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(REPLY_PREFIX + json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
