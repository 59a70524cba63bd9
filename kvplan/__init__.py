"""kvplan: plans the KV cache of LLM inference engines.

`kvplan.core` is the pure planning library, `kvplan.v1` the generated wire
contract, `kvplan.client` the thin client and `kvplan.server` the service.
"""

__version__ = "0.1.0"
