"""The thin client builds a PlanRequest from a config with kvplan's core unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

MODELS = Path(__file__).parents[2] / "examples" / "models"


def test_client_helper_needs_no_core(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        blocked = ("prometheus_client", "yaml", "torch", "grpc_health", "grpc_reflection",
                   "grpc_status", "redis", "pynvml", "kvplan.server", "kvplan.core",
                   "kvplan.convert")
        class Block:
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in blocked):
                    raise ImportError(f"blocked {name}")
                return None
        sys.meta_path.insert(0, Block())
        from kvplan.client import ModelPlanOptions, build_plan_request
        from kvplan.models import Speculative, load_config
        request, inputs = build_plan_request(
            load_config(sys.argv[1]),
            ModelPlanOptions(tensor_parallel_size=8, gpu="H200-141GB",
                             speculative=Speculative("mtp", 1)),
        )
        worker = request.workers[0]
        print(len(request.workers), len(worker.layers), worker.layers[-1].name,
              worker.layers[-1].is_draft, worker.layers[0].WhichOneof("kind"),
              inputs.weights.quantization)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(MODELS / "deepseek-v3")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "8", "62", "model.layers.61.self_attn.attn", "True", "mla_attention", "fp8"
    ]  # fmt: skip
