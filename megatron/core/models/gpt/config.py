"""GPTModelConfig: the shape and numerics of the GPT model, with Megatron-DeepSpeed's flag names and defaults.

Fields carry the names of Megatron-DeepSpeed's flags (``num_layers`` <- ``--num-layers``, ...), so the
trainer converts its parsed arguments field by field. Five are derived rather than parsed:
``padded_vocab_size`` (tokenizer + --make-vocab-size-divisible-by / --pad-vocab-size-to),
``params_dtype`` (--fp16 / --bf16), ``attention_impl`` (no Megatron-DeepSpeed flag, see the class docstring),
``stable_embedding`` (--use-bnb-optimizer: bitsandbytes' StableEmbedding, see the class docstring) and
``fp8`` (Megatron-LM's --fp8-format and recipe flags, see the class docstring).
Validation happens at construction and names the flags; ``validate_for_tensor_parallel`` adds the
checks that depend on the TP degree.
"""
from dataclasses import dataclass

import torch

from megatron.core.dtypes import DTYPES
from megatron.core.parallel_state import TP_FLAG, check_divisible
from megatron.core.tensor_parallel.fp8 import Fp8Config

POSITION_EMBEDDING_TYPES = ("absolute", "rotary", "alibi")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
GLU_ACTIVATIONS = ("geglu", "liglu", "reglu", "swiglu")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "materialized")
RECOMPUTE_METHODS = ("uniform", "block")
# selective recompute's modules: Megatron-LM's names, and mlp_act (the MLP's activation alone)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp_act", "mlp")
# selective recompute without a module list: the most memory for the least recompute time, measured
# (docs/memory.md, "Activation recompute"): elementwise work only, no GEMM and no attention again
SELECTIVE_RECOMPUTE_DEFAULT = ("layernorm", "mlp_act")
PARAMS_DTYPES = tuple(DTYPES.values())


class GPTConfigError(ValueError):
    """A model configuration that cannot work; the message names the flags and the fix."""


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class GPTModelConfig:
    """Hyper-parameters of a decoder-only transformer, in Megatron-DeepSpeed's vocabulary.

    h = hidden_size, n = num_attention_heads, hn = kv_channels (default h / n),
    g = num_query_groups (key/value groups of grouped-query attention, default n: multi-head),
    ffn = ffn_hidden_size (default 4h), V = padded_vocab_size, L = num_layers.
    ``padded_vocab_size`` is the vocabulary after padding (--make-vocab-size-divisible-by /
    --pad-vocab-size-to); the padding rows are ordinary classes that targets never hit.

    ``stable_embedding`` (with ``embed_layernorm``) is bitsandbytes' StableEmbedding as Megatron-DeepSpeed
    builds it with --use-bnb-optimizer: the word table drawn Xavier-uniform from its full [V, h] shape
    and a LayerNorm after the lookup (the trainer adds 32-bit optimizer state for the table).

    ``sequence_parallel`` (--sequence-parallel, meaningful with TP > 1): outside the tensor-parallel
    regions the activations [s, b, h] are split along the sequence over the TP ranks, so layer norms,
    dropouts and residual adds run on s / tp positions; the column-parallel GEMMs all-gather their
    input and the row-parallel ones reduce-scatter their output instead of one all-reduce.
    ``tp_comm_overlap`` (--tp-comm-overlap, with sequence parallelism) pipelines those collectives
    with their GEMMs through symmetric GPU memory (``tensor_parallel.async_tp.all_gather_matmul``,
    ``matmul_reduce_scatter``); it keeps each gathered column-parallel input for backward instead
    of gathering it again. On CPU the same arithmetic runs through the plain collectives.

    ``fp8`` (--fp8-format and its recipe flags; None: no FP8) runs the GEMMs of the four linear layers
    of each transformer layer (query/key/value, attention output, the MLP's two) in FP8, except in the
    first ``num_layers_at_start_in_bf16`` and the last ``num_layers_at_end_in_bf16`` layers
    (--first-last-layers-bf16), which keep the model's precision (``fp8_for_layer``); embeddings and
    the output layer never use FP8. A checkpoint's plain dict of ``fp8`` is taken as its Fp8Config.

    Llama-class options: ``normalization`` "RMSNorm" (x / rms(x) * w, no bias) instead of LayerNorm;
    ``num_query_groups`` g < n shares each key/value head among n / g query heads (g = 1: multi-query);
    ``rotary_base`` and ``rotary_percent`` (the share of each head's channels that rotates) and Llama
    3's frequency scaling (``use_rope_scaling``: factor, low and high frequency factors, original
    context; positional.rotary_inverse_frequencies); ``untie_embeddings_and_output_weights`` gives the
    output layer its own [V, h] weight; ``add_bias_linear`` False drops the biases of every linear layer,
    ``add_qkv_bias`` puts one back on the query/key/value projection (Qwen2).

    ``attention_impl`` chooses how attention is computed:
    "sdpa" (default) runs torch's scaled_dot_product_attention (flash / cuDNN / memory-efficient on
    GPU); "materialized" forms the [b, n, s, s] scores as Megatron-DeepSpeed does (query-key layer scaling,
    fused scale-mask-softmax, dropout, matmul with the values). Both compute the same function.

    Activation recompute, Megatron-LM's granularities: ``checkpoint_activations`` is full recompute,
    with ``recompute_method`` "uniform" (chunks of ``checkpoint_num_layers`` layers, each checkpointed
    as a unit) or "block" (the first ``checkpoint_num_layers`` layers of each pipeline stage, one by
    one; the rest keep their activations). A non-empty ``recompute_modules`` is selective recompute
    inside every layer: "core_attn" (the attention between the two projections), "layernorm" (the
    two norms' outputs), "mlp_act" (the MLP's activation output), "mlp" (the whole MLP); with
    ``recompute_method`` "block", inside the first ``checkpoint_num_layers`` layers of each pipeline
    stage only (our extension of Megatron-LM's flags: recompute just enough to fit). Dropout masks
    are replayed exactly (``tensor_parallel.random``).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    seq_length: int
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    num_query_groups: int | None = None
    max_position_embeddings: int | None = None
    position_embedding_type: str = "absolute"
    layernorm_epsilon: float = 1e-5
    normalization: str = "LayerNorm"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    apply_residual_connection_post_layernorm: bool = False
    embed_layernorm: bool = False
    stable_embedding: bool = False
    glu_activation: str | None = None
    openai_gelu: bool = False
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    masked_softmax_fusion: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    apply_query_key_layer_scaling: bool = True
    attention_softmax_in_fp32: bool = False
    fp32_residual_connection: bool = False
    params_dtype: torch.dtype = torch.float32
    use_cpu_initialization: bool = False
    seed: int = 1234
    checkpoint_activations: bool = False
    checkpoint_num_layers: int = 1
    distribute_checkpointed_activations: bool = False
    recompute_method: str = "uniform"
    recompute_modules: tuple[str, ...] = ()
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    attention_impl: str = "sdpa"
    fp8: Fp8Config | None = None
    num_layers_at_start_in_bf16: int = 0
    num_layers_at_end_in_bf16: int = 0

    def __post_init__(self):
        self._check_sizes()
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise GPTConfigError(
                    f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                    f"({self.num_attention_heads}) when --kv-channels is not given; set --kv-channels")
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        for name in ("ffn_hidden_size", "kv_channels", "num_query_groups"):
            if getattr(self, name) < 1:
                raise GPTConfigError(f"{_flag(name)} must be a positive integer, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise GPTConfigError(f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                                 f"--num-query-groups ({self.num_query_groups}): each key/value group serves "
                                 "the same number of query heads")
        if self.normalization not in NORMALIZATIONS:
            raise GPTConfigError(f"--normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        self._check_positions()
        self._check_activation()
        self._check_numerics()
        self._check_fp8()

    def _check_sizes(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size", "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "the padded vocabulary size" if name == "padded_vocab_size" else _flag(name)
                raise GPTConfigError(f"{flag} must be a positive integer, got {value!r}")

    def _check_positions(self):
        kind = self.position_embedding_type
        if kind not in POSITION_EMBEDDING_TYPES:
            raise GPTConfigError(f"--position-embedding-type must be one of {POSITION_EMBEDDING_TYPES}, got {kind!r}")
        if kind == "rotary":
            self._check_rotary()
        elif self.max_position_embeddings is None:
            raise GPTConfigError(f"--max-position-embeddings is required with --position-embedding-type {kind}; "
                                 f"set it to at least --seq-length ({self.seq_length})")
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            raise GPTConfigError(f"--max-position-embeddings ({self.max_position_embeddings}) must be >= "
                                 f"--seq-length ({self.seq_length}) with --position-embedding-type {kind}")

    def _check_rotary(self):
        if not 0.0 < self.rotary_percent <= 1.0:
            raise GPTConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_dim % 2 != 0 or self.rotary_dim == 0:
            raise GPTConfigError(f"rotary embeddings rotate pairs of channels: --kv-channels ({self.kv_channels}) "
                                 f"x --rotary-percent ({self.rotary_percent}) = {self.rotary_dim} must be even "
                                 "and positive")
        if self.rotary_base <= 0:
            raise GPTConfigError(f"--rotary-base must be > 0, got {self.rotary_base}")
        if self.use_rope_scaling:
            if self.rope_scaling_factor < 1.0 or self.rope_scaling_original_max_position_embeddings < 1:
                raise GPTConfigError("--rope-scaling-factor must be >= 1 and "
                                     "--rope-scaling-original-max-position-embeddings >= 1")
            if not 0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor:
                raise GPTConfigError(f"Llama 3 rope scaling needs 0 < --rope-scaling-low-freq-factor "
                                     f"({self.rope_scaling_low_freq_factor}) < --rope-scaling-high-freq-factor "
                                     f"({self.rope_scaling_high_freq_factor})")

    def _check_activation(self):
        if self.glu_activation is None:
            return
        if self.glu_activation not in GLU_ACTIVATIONS:
            raise GPTConfigError(f"--glu-activation must be one of {GLU_ACTIVATIONS}, got {self.glu_activation!r}")
        if self.bias_gelu_fusion:
            raise GPTConfigError("--glu-activation requires --no-bias-gelu-fusion (the fused bias-GeLU kernel "
                                 "cannot apply a gated activation)")

    def _check_numerics(self):
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise GPTConfigError(f"{_flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.init_method_std <= 0:
            raise GPTConfigError(f"--init-method-std must be > 0, got {self.init_method_std}")
        if self.layernorm_epsilon <= 0:
            raise GPTConfigError(f"--layernorm-epsilon must be > 0, got {self.layernorm_epsilon}")
        if self.params_dtype not in PARAMS_DTYPES:
            raise GPTConfigError(f"params dtype must be one of {PARAMS_DTYPES} (--fp16 / --bf16 / neither), "
                                 f"got {self.params_dtype}")
        self._check_recompute()
        if self.sequence_parallel and self.distribute_checkpointed_activations:
            raise GPTConfigError("--sequence-parallel already splits the checkpointed activations over the TP "
                                 "ranks: drop --distribute-checkpointed-activations / --partition-activations")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise GPTConfigError("--tp-comm-overlap pipelines the all-gathers and reduce-scatters of sequence "
                                 "parallelism with their GEMMs: add --sequence-parallel (with TP > 1)")
        if self.stable_embedding and not self.embed_layernorm:
            raise GPTConfigError("a stable embedding (--use-bnb-optimizer) has a LayerNorm after the word embedding: "
                                 "it needs embed_layernorm")
        if self.attention_impl not in ATTENTION_IMPLEMENTATIONS:
            raise GPTConfigError(f"attention implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
                                 f"got {self.attention_impl!r}")

    def _check_recompute(self):
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))  # a list from saved args
        if self.checkpoint_num_layers < 1:
            raise GPTConfigError(f"--checkpoint-num-layers / --recompute-num-layers must be >= 1, "
                                 f"got {self.checkpoint_num_layers}")
        if self.distribute_checkpointed_activations and not self.checkpoint_activations:
            raise GPTConfigError("--distribute-checkpointed-activations / --partition-activations require "
                                 "full recompute (--checkpoint-activations or --recompute-granularity full)")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise GPTConfigError(f"--recompute-method must be one of {RECOMPUTE_METHODS}, "
                                 f"got {self.recompute_method!r}")
        if self.recompute_method == "block" and self.checkpoint_num_layers > self.num_layers:
            raise GPTConfigError(f"--recompute-method block recomputes the first --recompute-num-layers "
                                 f"({self.checkpoint_num_layers}) layers: at most --num-layers ({self.num_layers})")
        unknown = sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES))
        if unknown:
            raise GPTConfigError(f"--recompute-modules {' '.join(unknown)}: selective recompute knows "
                                 f"{' '.join(RECOMPUTE_MODULES)}")
        if self.recompute_modules and self.checkpoint_activations:
            raise GPTConfigError("selective recompute (--recompute-granularity selective) and full recompute "
                                 "(--checkpoint-activations) exclude each other: keep one")
        if "layernorm" in self.recompute_modules and self.apply_residual_connection_post_layernorm:
            raise GPTConfigError("--recompute-modules layernorm frees the norms' outputs, which "
                                 "--apply-residual-connection-post-layernorm keeps as the residual: drop one")

    def _check_fp8(self):
        if isinstance(self.fp8, dict):  # a checkpoint's args.model
            object.__setattr__(self, "fp8", Fp8Config(**self.fp8))
        start, end = self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16
        if start < 0 or end < 0:
            raise GPTConfigError(f"--num-layers-at-start-in-bf16 ({start}) and --num-layers-at-end-in-bf16 ({end}) "
                                 "must be >= 0")
        if self.fp8 is None:
            if start or end:
                raise GPTConfigError("--first-last-layers-bf16 keeps layers out of FP8: it needs --fp8-format")
            return
        if start + end >= self.num_layers:
            raise GPTConfigError(f"--num-layers-at-start-in-bf16 ({start}) + --num-layers-at-end-in-bf16 ({end}) "
                                 f"leave none of the --num-layers ({self.num_layers}) in FP8: lower them, or "
                                 "drop --fp8-format")

    def fp8_for_layer(self, layer_number: int) -> Fp8Config | None:
        """The FP8 settings of transformer layer ``layer_number`` (1-based, over the whole model), None
        for the layers kept in the model's precision."""
        if self.fp8 is None:
            return None
        in_fp8 = self.num_layers_at_start_in_bf16 < layer_number <= self.num_layers - self.num_layers_at_end_in_bf16
        return self.fp8 if in_fp8 else None

    @property
    def recompute_granularity(self) -> str | None:
        """Megatron-LM's name of the mode: "full" (whole layers, --checkpoint-activations),
        "selective" (``recompute_modules`` inside each layer) or None."""
        if self.checkpoint_activations:
            return "full"
        return "selective" if self.recompute_modules else None

    @property
    def projection_size(self) -> int:
        """n * hn: the width of the queries (and of keys and values)."""
        return self.kv_channels * self.num_attention_heads

    @property
    def queries_per_group(self) -> int:
        """n / g: the query heads that share one key/value head."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def key_value_size(self) -> int:
        """g * hn: the width of the keys (and of the values)."""
        return self.num_query_groups * self.kv_channels

    @property
    def query_key_value_size(self) -> int:
        """(n + 2g) hn: the width of the query/key/value projection."""
        return self.projection_size + 2 * self.key_value_size

    @property
    def rotary_dim(self) -> int:
        """The channels of each head that rotary embeddings rotate: hn x --rotary-percent."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def qkv_bias(self) -> bool:
        """Whether the query/key/value projection has a bias (--disable-bias-linear, --add-qkv-bias)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def softmax_in_fp32(self) -> bool:
        """Query-key layer scaling forces the softmax into fp32, as in Megatron-DeepSpeed."""
        return self.attention_softmax_in_fp32 or self.apply_query_key_layer_scaling

    def validate_for_tensor_parallel(self, tensor_model_parallel_size: int) -> None:
        """Raise ParallelConfigError unless heads, ffn and vocabulary split evenly over the TP ranks.

        The trainer calls it once, when it builds the config; the layers' own splits (``divide``)
        raise for a library user who skips it."""
        tp = tensor_model_parallel_size
        check_divisible(self.num_attention_heads, tp, "--num-attention-heads", TP_FLAG)
        if self.num_query_groups % tp != 0:
            raise GPTConfigError(f"the TP ranks split the key/value groups: --num-query-groups "
                                 f"({self.num_query_groups}) must be divisible by {TP_FLAG} ({tp}); use a "
                                 "TP degree that divides the groups")
        check_divisible(self.ffn_hidden_size, tp, "--ffn-hidden-size", TP_FLAG)
        if self.sequence_parallel:
            check_divisible(self.seq_length, tp, "--seq-length (split over the TP ranks by --sequence-parallel)",
                            TP_FLAG)
        check_divisible(self.padded_vocab_size, tp,
                        "the padded vocabulary size (--make-vocab-size-divisible-by, --pad-vocab-size-to)", TP_FLAG)

    def validate_for_ulysses(self, tensor_model_parallel_size: int, sequence_parallel_size: int) -> None:
        """Raise GPTConfigError unless DeepSpeed-Ulysses over S = ``sequence_parallel_size`` ranks can
        split this model: the sequence into S slices, and each TP rank's heads and key/value groups
        into S shares (attention's all-to-all). Called once by the trainer, with the TP checks."""
        if sequence_parallel_size == 1:
            return
        tp, sp = tensor_model_parallel_size, sequence_parallel_size
        flag = f"--ds-sequence-parallel-size ({sp})"
        shares = ((self.num_attention_heads // tp, "--num-attention-heads", self.num_attention_heads),
                  (self.num_query_groups // tp, "--num-query-groups", self.num_query_groups))
        for per_rank, name, total in shares:
            if per_rank % sp != 0:
                raise GPTConfigError(f"{name} ({total}) / {TP_FLAG} ({tp}) = {per_rank} per TP rank is not "
                                     f"divisible by {flag}: attention's all-to-all hands each sequence-parallel "
                                     f"rank 1 / S of them; choose S dividing {per_rank}")
        if self.seq_length % sp != 0:
            raise GPTConfigError(f"--seq-length ({self.seq_length}) is not divisible by {flag}: each "
                                 f"sequence-parallel rank holds 1 / S of the positions")
        if self.sequence_parallel and self.seq_length % (sp * tp) != 0:
            raise GPTConfigError(f"--seq-length ({self.seq_length}) is not divisible by {flag} x {TP_FLAG} "
                                 f"({tp}): --sequence-parallel splits each sequence-parallel rank's "
                                 f"{self.seq_length // sp} positions over the TP ranks")
