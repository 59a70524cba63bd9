"""Model configs in, layer specs out: plan a real model from its Hugging Face config.

Pure Python (stdlib + kvplan's core and protobuf stubs), so the thin client can use it.
"""

from kvplan.models.config import HFConfig, ModelConfigError, load_config
from kvplan.models.importer import (
    Deployment,
    ModelLayers,
    Speculative,
    UnsupportedModel,
    import_layers,
    supported_architectures,
)

__all__ = [
    "Deployment",
    "HFConfig",
    "ModelConfigError",
    "ModelLayers",
    "Speculative",
    "UnsupportedModel",
    "import_layers",
    "load_config",
    "supported_architectures",
]
