"""Typed planning inputs: engine options, spec-decode setup, workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplan.core.extensible import DEFAULT_ALLOCATION_GRANULE_BYTES
from kvplan.core.hisparse import HiSparseConfig
from kvplan.core.layout import KVCacheLayout
from kvplan.core.rules import KVPLAN, DraftSlotCheck, RuleSet
from kvplan.core.specs import KVCacheSpec

DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

# Drafters that read the target's hidden states (vLLM's `use_eagle()`).
EAGLE_FAMILY = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
# Target model types whose drafter caches are the trailing layers.
TRAILING_DRAFT_MODEL_TYPES = frozenset({"deepseek_v4", "deepseek_v41"})


@dataclass(frozen=True)
class SpecDecode:
    method: str = "none"  # "eagle", "eagle3", "mtp", "dspark", "dflash", "ngram", ...
    num_speculative_tokens: int = 0
    target_model_type: str = ""
    disable_eagle_block_drop: bool = False
    num_nextn_predict_layers: int = 1
    # speculative_config.parallel_drafting as asked; None = unset.
    parallel_drafting: bool | None = None

    @property
    def drafts_in_parallel(self) -> bool:
        """DFlash and DSpark always draft in parallel (vLLM sets it for them); the
        other methods as asked."""
        return self.method in ("dflash", "dspark") or bool(self.parallel_drafting)

    @property
    def uses_eagle(self) -> bool:
        return self.method in EAGLE_FAMILY

    def block_drop_enabled(self, rules: RuleSet) -> bool:
        """The draft-annotation gate: the release's drop methods, not disabled."""
        return self.method in rules.block_drop_methods and not self.disable_eagle_block_drop

    def warns_unflagged(self, rules: RuleSet) -> bool:
        """Whether an unflagged Mamba group draws the no-draft-group warning."""
        if self.method not in rules.warning_methods:
            return False
        return not (rules.warning_needs_block_drop and self.disable_eagle_block_drop)

    @property
    def uses_trailing_draft_layers(self) -> bool:
        return self.uses_eagle and (
            self.method == "mtp" or self.target_model_type in TRAILING_DRAFT_MODEL_TYPES
        )

    @property
    def multi_module_mtp(self) -> bool:
        return (
            self.method == "mtp"
            and min(self.num_nextn_predict_layers, self.num_speculative_tokens) > 1
        )

    def max_decode_query_len(self, rules: RuleSet) -> int:
        """Widest decode query (model runner V2): the token plus the drafts, plus the
        query rows the release's drafter appends (0.34: an autoregressive draft model
        keeps one unsliced token)."""
        if self.method == "none":
            return 1
        extra = 1 if self.method == "draft_model" and rules.draft_model_extra_query_slot else 0
        return 1 + self.num_speculative_tokens + extra

    def batch_slots_for_drafting(self, rules: RuleSet) -> int:
        """Tokens of a scheduler step the drafter takes per request, as the release's
        VllmConfig counts them: max_num_batched_tokens must exceed it."""
        k = self.num_speculative_tokens
        if rules.draft_slot_check is DraftSlotCheck.NEW_SLOTS_FOR_DRAFTING:
            # A parallel drafter's query rows past the first (DFlash: all K, as its
            # bonus query is its own; a parallel draft model, PARD: all K too).
            if self.method == "dflash":
                return k
            if self.drafts_in_parallel:
                return k if self.method == "draft_model" else k - 1
            return 1 if self.method == "draft_model" else 0
        if self.method == "dflash":
            return k + 1  # the lookahead: a bonus query plus one per draft token
        return k if self.uses_eagle or self.method == "draft_model" else 0

    def step_draft_slots(self, rules: RuleSet) -> int:
        """Query rows the drafter adds to a scheduler step per request (vLLM's
        `max_num_new_slots_for_drafting`): a prefill chunk takes at most
        max_num_batched_tokens less these. 0.32 counts as its VllmConfig check does;
        later releases draft DFlash and DSpark in a pass of their own."""
        if self.method == "none":
            return 0
        if rules.draft_slot_check is DraftSlotCheck.NEW_SLOTS_FOR_DRAFTING:
            return self.batch_slots_for_drafting(rules)
        if self.method in ("dflash", "dspark"):
            return 0
        k = self.num_speculative_tokens
        if self.drafts_in_parallel:
            return k if self.method == "draft_model" else k - 1
        return 1 if self.method == "draft_model" else 0

    @property
    def prefill_lookahead_tokens(self) -> int:
        """Prefill tokens past the computed range that the drafter reads."""
        if not self.uses_eagle:
            return 0
        return self.num_speculative_tokens if self.multi_module_mtp else 1


@dataclass(frozen=True)
class EngineOptions:
    max_model_len: int  # tokens; -1 = auto-fit up to derived_max_model_len
    derived_max_model_len: int  # the model's own maximum (auto-fit ceiling)
    block_size: int = DEFAULT_BLOCK_SIZE
    disable_hybrid_kv_cache_manager: bool = False
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    async_scheduling: bool = False
    use_v2_model_runner: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    # The layout asked for; None: resolved from the workers' supported_layouts,
    # LBNHC when they list none (kvplan/core/layout_resolution.py).
    layout: KVCacheLayout | None = None
    max_num_encoder_input_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    prefix_match_unit: int | None = None
    # vLLM 0.34's extensible KV cache: plan a reservation, or the final plan from
    # the workers' measured KV bytes.
    extensible_kv_cache: bool = False
    # HiSparse sparse-MLA offloading (None: off); implies model runner V2.
    hisparse: HiSparseConfig | None = None
    # vLLM's enable_mamba_shared_prefix_checkpoint: only the prefix-cache
    # prediction reads it (kvplan.core.prefix_cache.PrefixCacheSetup).
    mamba_shared_prefix_checkpoint: bool = False

    @property
    def mamba_align_mode(self) -> bool:
        """Mamba layers keep "align"-mode state exactly when prefix caching is on:
        vLLM sets the mode from it, whatever was asked for."""
        return self.enable_prefix_caching

    @property
    def auto_fit(self) -> bool:
        return self.max_model_len == -1

    @property
    def starting_max_model_len(self) -> int:
        return self.derived_max_model_len if self.auto_fit else self.max_model_len

    def max_in_flight_tokens(self, rules: RuleSet) -> int:
        """Tokens scheduled but not yet settled: every batch in flight may be full."""
        batches = rules.max_concurrent_batches(
            pipeline_parallel_size=self.pipeline_parallel_size,
            async_scheduling=self.async_scheduling,
            # HiSparse runs only on model runner V2.
            use_v2_model_runner=self.use_v2_model_runner or self.hisparse is not None,
        )
        return batches * self.max_num_batched_tokens


@dataclass(frozen=True)
class NonKVMemory:
    """What the worker already uses besides the KV cache (bytes)."""

    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    non_torch_bytes: int = 0
    cuda_graph_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.activation_peak_bytes
            + self.non_torch_bytes
            + self.cuda_graph_bytes
        )


@dataclass(frozen=True)
class MemoryRequest:
    """At most one of the three budget modes; none set means utilization 0.92."""

    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    free_memory_fraction: float | None = None  # of device.free_memory_bytes
    non_kv: NonKVMemory = field(default_factory=NonKVMemory)
    device_bytes_in_use: int = 0  # already held by this worker when it asks
    # Extensible KV cache: bytes measured for the KV cache after warm-up, and the
    # device's physical allocation granule.
    measured_kv_cache_bytes: int | None = None
    allocation_granule_bytes: int = DEFAULT_ALLOCATION_GRANULE_BYTES


@dataclass(frozen=True)
class DeviceInfo:
    uuid: str = ""
    name: str = ""
    total_memory_bytes: int | None = None
    free_memory_bytes: int | None = None


@dataclass(frozen=True)
class WorkerInput:
    rank: int
    layers: tuple[tuple[str, KVCacheSpec], ...]  # registration order
    memory: MemoryRequest = field(default_factory=MemoryRequest)
    device: DeviceInfo = field(default_factory=DeviceInfo)
    encoder_only_layers: tuple[str, ...] = ()
    # The layouts all this worker's attention backends support, most preferred first.
    supported_layouts: tuple[KVCacheLayout, ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    engine_id: str
    options: EngineOptions
    workers: tuple[WorkerInput, ...]
    spec_decode: SpecDecode = field(default_factory=SpecDecode)
    rules: RuleSet = KVPLAN  # the engine release whose rules plan this request


def configured_prefix_caching(
    requested: bool | None,
    *,
    decoder_attention: bool,
    mamba: bool,
    cross_attention: bool,
    rswa: bool,
) -> bool:
    """Prefix caching as vLLM's configuration settles it, from the request's value
    and the target model's layers (a drafter's do not count).

    Unset, vLLM's default: on for decoder and hybrid (Mamba and attention) models;
    off for attention-free (Mamba only), encoder-decoder (cross-attention) and
    encoder-only models (pooling decoders with mean or CLS pooling default to off
    too; nothing in the layers says so). A model with RSWA layers (Unlimited-OCR,
    the only one) has it off whatever was asked: its config hook says so. vLLM then
    runs Mamba layers in "align" mode exactly when prefix caching is on."""
    if rswa:
        return False
    if requested is not None:
        return requested
    if mamba and decoder_attention:
        return True  # hybrid: vLLM asks that before encoder-decoder
    return decoder_attention and not cross_attention
