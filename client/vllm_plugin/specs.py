"""vLLM KV-cache spec objects <-> kvplan `LayerSpec`: the one place the two meet.

Every spec class of vLLM 0.32, 0.33 and 0.34 (the same classes in all three) is
listed in `SPEC_KINDS` with the `LayerSpec.kind` it becomes, and
`ATTENTION_FIELDS` / `KIND_FIELDS` / `MAMBA_FIELDS` name the field pairs.
`to_layer_spec` reads a vLLM spec through those tables; `from_layer_spec` builds a
vLLM spec from a `LayerSpec` through the same tables (the direction `conformance/`
needs), so the two directions cannot drift. A field a release lacks is simply
absent (0.32 has neither `is_draft` nor MLA's `topk_buffer_width`; 0.34 adds
`kv_head_major_slots`, Mamba `state_alignment` and SlidingWindowMLA's
`non_causal_multi_token_decode`): both directions read the spec class's own fields.
A vLLM field kvplan cannot represent (a value other than its default) or a class
kvplan has no kind for raises `UnsupportedSpec`: the plugin then leaves the engine
to vLLM rather than plan something else.

Nothing here imports vllm or torch: classes and enums are reached through the
spec objects themselves (`from_layer_spec` takes vLLM's module as an argument).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

from kvplan.v1 import spec_pb2


class UnsupportedSpec(ValueError):
    """A vLLM spec kvplan cannot represent exactly."""


# vLLM class name -> LayerSpec oneof field. Subclasses come before their bases
# (the most derived class decides).
SPEC_KINDS: dict[str, str] = {
    "HiddenStateCacheSpec": "hidden_state_cache",
    "MLAAttentionSpec": "mla_attention",
    "SinkFullAttentionSpec": "sink_full_attention",
    "RSWASpec": "rswa",
    "FullAttentionSpec": "full_attention",
    "SlidingWindowMLASpec": "sliding_window_mla",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "CrossAttentionSpec": "cross_attention",
    "EncoderOnlyAttentionSpec": "encoder_only_attention",
    "CircularBufferSpec": "circular_buffer",
    "MambaSpec": "mamba",
    "HiSparseHotSpec": "hisparse_hot",
    "HiSparseResidentSpec": "hisparse_resident",
}
# Spec classes of the supported releases that are not a layer's input: vLLM's
# planner builds UniformTypeKVCacheSpecs from the layers' own specs.
UNSUPPORTED_CLASSES = ("UniformTypeKVCacheSpecs",)

# AttentionParams field -> vLLM attribute (optional proto fields: None in vLLM = unset).
ATTENTION_FIELDS: dict[str, str] = {
    "num_kv_heads": "num_kv_heads",
    "head_size": "head_size",
    "head_size_v": "head_size_v",
    "page_size_padded_bytes": "page_size_padded",
    "num_head_slots": "num_head_slots",
    "state_content_bytes": "state_content_bytes",
    "max_tp_shards": "max_tp_shards",
    "dcp_sharded": "dcp_sharded",
    "kv_head_major_slots": "kv_head_major_slots",  # 0.34
}
# Per kind: proto field of the kind's message -> vLLM attribute.
KIND_FIELDS: dict[str, dict[str, str]] = {
    "full_attention": {
        "sliding_window": "sliding_window",
        "attention_chunk_size": "attention_chunk_size",
        "non_causal": "non_causal",
    },
    "mla_attention": {
        "is_index_group_leader": "is_index_group_leader",
        "non_causal_multi_token_decode": "non_causal_multi_token_decode",
    },
    "hidden_state_cache": {},
    "sliding_window": {"sliding_window": "sliding_window"},
    "sliding_window_mla": {
        "sliding_window": "sliding_window",
        "bounded_replay": "bounded_replay",
        "non_causal_multi_token_decode": "non_causal_multi_token_decode",  # 0.34
    },
    "chunked_local_attention": {"attention_chunk_size": "attention_chunk_size"},
    "sink_full_attention": {
        "sink_len": "sink_len",
        "sliding_window": "sliding_window",
        "attention_chunk_size": "attention_chunk_size",
        "non_causal": "non_causal",
    },
    "rswa": {"rswa_window": "rswa_window"},
    "cross_attention": {},
    "encoder_only_attention": {},
    "circular_buffer": {},
}
MLA_KINDS = ("mla_attention", "hidden_state_cache", "sliding_window_mla")
# MLAParams field -> vLLM attribute.
MLA_FIELDS: dict[str, str] = {
    "topk_buffer_width": "topk_buffer_width",
    "alignment_bytes": "alignment",
}
MAMBA_FIELDS: dict[str, str] = {
    "page_size_padded_bytes": "page_size_padded",
    "num_speculative_blocks": "num_speculative_blocks",
    "num_prefill_checkpoint_blocks": "num_prefill_checkpoint_blocks",
    "prefill_checkpoint_alignment": "prefill_checkpoint_alignment",
    "num_heads": "num_heads",
    "tp_replicated": "tp_replicated",
    "state_alignment_bytes": "state_alignment",  # 0.34
}
# Fields a later release added whose default is the proto's unset value: sent only
# away from that default, so an engine that does not use them stays plannable under
# a rule set without them (kvplan's own, or an earlier release's).
ADDED_FIELD_DEFAULTS: dict[str, object] = {
    "kv_head_major_slots": False,
    "state_alignment": 1,
    "non_causal_multi_token_decode": False,
}
# HiSparse kinds (no attention parameters): proto field -> vLLM attribute.
HISPARSE_FIELDS: dict[str, dict[str, str]] = {
    "hisparse_hot": {"page_size_bytes": "page_size", "blocks_per_request": "blocks_per_request"},
    "hisparse_resident": {"page_size_bytes": "page_size"},
}
# vLLM attributes that are derived by vLLM's own planning (not an input) or are
# options of the engine rather than of the layer: never sent per layer.
DERIVED_FIELDS = frozenset({"extra_retained_tokens", "mamba_cache_mode", "is_draft"})

STORAGE_DTYPES: dict[str, int] = {
    "float32": spec_pb2.DTYPE_FLOAT32,
    "float16": spec_pb2.DTYPE_FLOAT16,
    "bfloat16": spec_pb2.DTYPE_BFLOAT16,
    "uint8": spec_pb2.DTYPE_UINT8,
    "int8": spec_pb2.DTYPE_INT8,
    "float8_e4m3fn": spec_pb2.DTYPE_FLOAT8_E4M3FN,
    "float8_e5m2": spec_pb2.DTYPE_FLOAT8_E5M2,
}
# MambaAttentionBackendEnum member name -> MambaType.
MAMBA_TYPES: dict[str, int] = {
    "MAMBA2": spec_pb2.MAMBA_TYPE_MAMBA2,
    "MAMBA1": spec_pb2.MAMBA_TYPE_MAMBA1,
    "SHORT_CONV": spec_pb2.MAMBA_TYPE_SHORT_CONV,
    "LINEAR": spec_pb2.MAMBA_TYPE_LINEAR,
    "GDN_ATTN": spec_pb2.MAMBA_TYPE_GDN_ATTENTION,
    "CUSTOM": spec_pb2.MAMBA_TYPE_CUSTOM,
}


def dtype_name(dtype: object) -> str:
    """ "torch.bfloat16" -> "bfloat16" (without importing torch)."""
    return str(dtype).removeprefix("torch.")


def storage_dtype(dtype: object, where: str) -> int:
    try:
        return STORAGE_DTYPES[dtype_name(dtype)]
    except KeyError:
        raise UnsupportedSpec(f"{where}: storage dtype {dtype} has no kvplan Dtype") from None


def cache_dtype(name: str | None) -> int:
    """A vLLM kv_cache_dtype string ("auto", "fp8_e4m3", ...) -> KVCacheDtype."""
    key = "KV_CACHE_DTYPE_" + (name or "auto").upper()
    try:
        return int(spec_pb2.KVCacheDtype.Value(key))
    except ValueError:
        raise UnsupportedSpec(f"kv_cache_dtype {name!r} has no kvplan KVCacheDtype") from None


def _kind_of(spec: object) -> str:
    for klass in type(spec).__mro__:
        kind = SPEC_KINDS.get(klass.__name__)
        if kind is not None:
            return kind
        if klass.__name__ in UNSUPPORTED_CLASSES:
            break
    raise UnsupportedSpec(f"vLLM spec class {type(spec).__name__} has no kvplan LayerSpec kind")


def _field_defaults(spec: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for f in dataclasses.fields(spec):  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _set(message: Any, field: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool):
        setattr(message, field, value)
    else:
        setattr(message, field, int(value))  # type: ignore[call-overload]


def _tokens_per_state(value: object, message: spec_pb2.TokensPerState, where: str) -> None:
    ratio = Fraction(value)  # type: ignore[call-overload]
    if ratio == 1:
        return
    if ratio.denominator == 1:
        message.tokens = ratio.numerator
    elif ratio.numerator == 1:
        message.states_per_token = ratio.denominator
    else:
        raise UnsupportedSpec(f"{where}: tokens_per_state {value} is not n or 1/n")


def to_layer_spec(name: str, spec: object) -> spec_pb2.LayerSpec:
    """The `LayerSpec` for vLLM layer `name` whose KV-cache spec is `spec`."""
    kind = _kind_of(spec)
    where = f"layer {name!r} ({type(spec).__name__})"
    layer = spec_pb2.LayerSpec(name=name, is_draft=bool(getattr(spec, "is_draft", False)))
    layer.block_size = int(spec.block_size)  # type: ignore[attr-defined]
    alignment = getattr(spec, "block_stride_alignment", None)
    if alignment is not None:
        if isinstance(alignment, int):
            layer.block_stride_alignment.bytes = alignment
        elif hasattr(alignment, "base"):  # vLLM's MultipleOf(kernel block tokens)
            layer.block_stride_alignment.multiple_of_kernel_block_tokens = int(alignment.base)
        else:
            raise UnsupportedSpec(f"{where}: block_stride_alignment {alignment!r}")
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}  # type: ignore[arg-type]
    defaults = _field_defaults(spec)
    used = {"block_size", "block_stride_alignment", *DERIVED_FIELDS}
    body = getattr(layer, kind)
    if kind in HISPARSE_FIELDS:
        for proto_field, attr in HISPARSE_FIELDS[kind].items():
            _set(body, proto_field, values[attr])
            used.add(attr)
    elif kind == "mamba":
        _mamba_fields(spec, body, where)
        used |= {"shapes", "dtypes", "mamba_type", *MAMBA_FIELDS.values()}
        if values.get("tokens_per_state", -1) != -1:
            raise UnsupportedSpec(f"{where}: Mamba tokens_per_state has no kvplan field")
        used.add("tokens_per_state")
    else:
        params = body.attention
        for proto_field, attr in ATTENTION_FIELDS.items():
            if kind in MLA_KINDS and attr == "head_size_v" and values.get(attr) == 0:
                continue  # MLA's default: no separate V head
            _set(params, proto_field, values.get(attr))
        params.dtype = storage_dtype(values["dtype"], where)
        params.kv_quant_mode = int(values["kv_quant_mode"])
        _tokens_per_state(values["tokens_per_state"], params.tokens_per_state, where)
        used |= {*ATTENTION_FIELDS.values(), "dtype", "kv_quant_mode", "tokens_per_state"}
        for proto_field, attr in KIND_FIELDS[kind].items():
            _set(body, proto_field, values.get(attr))
            used.add(attr)
        if kind in MLA_KINDS:
            body.mla.cache_dtype = cache_dtype(values.get("cache_dtype_str"))
            body.mla.model_version = values.get("model_version") or ""
            used |= {"cache_dtype_str", "model_version"}
            for proto_field, attr in MLA_FIELDS.items():
                if attr in values and (kind != "sliding_window_mla" or attr != "topk_buffer_width"):
                    _set(body.mla, proto_field, values[attr])
                    used.add(attr)
        if kind == "mla_attention":
            role = values["cache_role"]
            body.cache_role = (
                spec_pb2.SPARSE_CACHE_ROLE_INDEXER
                if getattr(role, "name", role) == "INDEXER"
                else spec_pb2.SPARSE_CACHE_ROLE_SPARSE
            )
            used.add("cache_role")
    # Everything else must sit at its default: kvplan would not see it.
    for field, value in values.items():
        if field in used:
            continue
        if field not in defaults or value != defaults[field]:
            raise UnsupportedSpec(f"{where}: {field}={value!r} has no kvplan field for this kind")
    return layer


def _mamba_fields(spec: Any, body: spec_pb2.MambaSpec, where: str) -> None:
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        body.states.add(shape=[int(d) for d in shape], dtype=storage_dtype(dtype, where))
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if kind not in MAMBA_TYPES:
        raise UnsupportedSpec(f"{where}: mamba_type {kind} has no kvplan MambaType")
    body.mamba_type = MAMBA_TYPES[kind]  # type: ignore[assignment]
    for proto_field, attr in MAMBA_FIELDS.items():
        value = getattr(spec, attr, None)
        if attr in ADDED_FIELD_DEFAULTS and value == ADDED_FIELD_DEFAULTS[attr]:
            continue
        _set(body, proto_field, value)


# --- the other direction: LayerSpec -> vLLM spec (for conformance and round trips) ---------


def from_layer_spec(
    layer: spec_pb2.LayerSpec,
    vllm: Any,
    *,
    torch: Any,
    mamba_cache_mode: str = "none",
) -> object:
    """The vLLM spec a fully specified `LayerSpec` stands for.

    `vllm` is a namespace holding vLLM's spec classes, `KVQuantMode`,
    `SparseCacheRole`, `MambaAttentionBackendEnum` and `MultipleOf` (e.g. built
    from vllm.v1.kv_cache_interface and friends); `torch` gives the dtypes. The
    layer's dtype, block size and MLA cache dtype must be set (no engine defaults
    are applied here). A field the running release's class lacks is left out when
    it holds the proto's unset value (False, 0, unset), and refused otherwise: the
    release could not express it.
    """
    kind = layer.WhichOneof("kind")
    if kind is None:
        raise UnsupportedSpec(f"layer {layer.name!r} has no kind")
    class_name = next(name for name, k in SPEC_KINDS.items() if k == kind)
    klass = getattr(vllm, class_name)
    kwargs = _spec_kwargs(layer, kind, vllm, torch=torch, mamba_cache_mode=mamba_cache_mode)
    accepted = {f.name for f in dataclasses.fields(klass)}
    for attr in [a for a in kwargs if a not in accepted]:
        value = kwargs.pop(attr)
        if value not in (None, False, 0):
            raise UnsupportedSpec(
                f"layer {layer.name!r}: {attr}={value!r} does not exist in this vLLM "
                f"release's {class_name}"
            )
    return klass(**kwargs)


def _spec_kwargs(
    layer: spec_pb2.LayerSpec, kind: str, vllm: Any, *, torch: Any, mamba_cache_mode: str
) -> dict[str, Any]:
    """The constructor arguments of `layer`'s vLLM spec (every release's fields)."""
    kwargs: dict[str, Any] = {"block_size": layer.block_size, "is_draft": layer.is_draft}
    which = layer.block_stride_alignment.WhichOneof("alignment")
    if which == "bytes":
        kwargs["block_stride_alignment"] = layer.block_stride_alignment.bytes
    elif which == "multiple_of_kernel_block_tokens":
        kwargs["block_stride_alignment"] = vllm.MultipleOf(
            layer.block_stride_alignment.multiple_of_kernel_block_tokens
        )
    dtypes = {number: getattr(torch, name) for name, number in STORAGE_DTYPES.items()}
    body = getattr(layer, kind)
    if kind in HISPARSE_FIELDS:
        for proto_field, attr in HISPARSE_FIELDS[kind].items():
            kwargs[attr] = getattr(body, proto_field)
        return kwargs
    if kind == "mamba":
        kwargs["shapes"] = tuple(tuple(int(d) for d in s.shape) for s in body.states)
        kwargs["dtypes"] = tuple(dtypes[s.dtype] for s in body.states)
        names = {number: name for name, number in MAMBA_TYPES.items()}
        kwargs["mamba_type"] = vllm.MambaAttentionBackendEnum[names[body.mamba_type]]
        kwargs["mamba_cache_mode"] = mamba_cache_mode
        for proto_field, attr in MAMBA_FIELDS.items():
            if not _optional(body, proto_field) or body.HasField(proto_field):
                kwargs[attr] = getattr(body, proto_field)
        kwargs["num_heads"] = kwargs["num_heads"] or 1  # the proto's "unset = 1"
        return kwargs
    params = body.attention
    for proto_field, attr in ATTENTION_FIELDS.items():
        if not _optional(params, proto_field) or params.HasField(proto_field):
            kwargs[attr] = getattr(params, proto_field)
    kwargs["dtype"] = dtypes[params.dtype]
    kwargs["kv_quant_mode"] = vllm.KVQuantMode(params.kv_quant_mode)
    tps = params.tokens_per_state.WhichOneof("value")
    if tps == "tokens":
        kwargs["tokens_per_state"] = params.tokens_per_state.tokens
    elif tps == "states_per_token" and params.tokens_per_state.states_per_token != 1:
        kwargs["tokens_per_state"] = Fraction(1, params.tokens_per_state.states_per_token)
    for proto_field, attr in KIND_FIELDS[kind].items():
        if not _optional(body, proto_field) or body.HasField(proto_field):
            kwargs[attr] = getattr(body, proto_field)
    if kind in MLA_KINDS:
        name = spec_pb2.KVCacheDtype.Name(body.mla.cache_dtype)
        kwargs["cache_dtype_str"] = name.removeprefix("KV_CACHE_DTYPE_").lower()
        kwargs["model_version"] = body.mla.model_version or None
        for proto_field, attr in MLA_FIELDS.items():
            if kind == "sliding_window_mla" and attr == "topk_buffer_width":
                continue
            if body.mla.HasField(proto_field):
                kwargs[attr] = getattr(body.mla, proto_field)
    if kind == "mla_attention":
        kwargs["cache_role"] = (
            vllm.SparseCacheRole.INDEXER
            if body.cache_role == spec_pb2.SPARSE_CACHE_ROLE_INDEXER
            else vllm.SparseCacheRole.SPARSE
        )
    return kwargs


def with_engine_defaults(
    layer: spec_pb2.LayerSpec, *, block_size: int, mamba_block_size: int, storage_dtype: int
) -> spec_pb2.LayerSpec:
    """A copy of `layer` with what the engine decides filled in (kvplan's defaults:
    docs/semantics.md): the block size and the storage dtype of an attention layer
    that leaves them unset. `from_layer_spec` then builds the vLLM spec."""
    out = spec_pb2.LayerSpec()
    out.CopyFrom(layer)
    kind = out.WhichOneof("kind")
    if not out.HasField("block_size"):
        out.block_size = mamba_block_size if kind == "mamba" else block_size
    if kind is not None and kind != "mamba" and kind not in HISPARSE_FIELDS:
        params = getattr(out, kind).attention
        if params.dtype == spec_pb2.DTYPE_UNSPECIFIED:
            params.dtype = storage_dtype
    return out


def _optional(message: Any, field: str) -> bool:
    descriptor = message.DESCRIPTOR.fields_by_name[field]
    return bool(descriptor.has_presence)


__all__ = [
    "ATTENTION_FIELDS",
    "HISPARSE_FIELDS",
    "KIND_FIELDS",
    "MAMBA_FIELDS",
    "SPEC_KINDS",
    "UnsupportedSpec",
    "from_layer_spec",
    "to_layer_spec",
    "with_engine_defaults",
]
