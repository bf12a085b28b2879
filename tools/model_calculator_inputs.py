"""The inputs of tools/model_calculator.py: the model's shape, the run's layout and the training budget,
as the trainer's flags give them, and the padded vocabulary the trainer derives."""
from dataclasses import dataclass

from megatron.core.tokenizer.gpt2_bpe import TokenizerError
from megatron.core.tokenizer.vocab_padding import vocab_size_with_padding

# learned = Megatron's absolute, rope = Megatron-LM's rotary
POSITION_EMBEDDING_TYPES = ("absolute", "learned", "rotary", "rope", "alibi")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
PRECISIONS = ("fp32", "fp16", "bf16")
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_METHODS = ("uniform", "block")


class CalculatorError(ValueError):
    """A model or layout that cannot work; the message names the flag."""


@dataclass(frozen=True)
class ModelShape:
    """The network size flags of pretrain_gpt.py."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    max_position_embeddings: int | None = None  # None: the sequence length
    vocab_size: int = 50257
    make_vocab_size_divisible_by: int = 128
    pad_vocab_size_to: int | None = None
    ffn_hidden_size: int | None = None  # None: 4h
    position_embedding_type: str = "absolute"
    untie_embeddings_and_output_weights: bool = False
    embed_layernorm: bool = False
    normalization: str = "LayerNorm"
    num_query_groups: int | None = None  # None: one per head (multi-head attention)
    swiglu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0

    @property
    def ffn(self) -> int:
        """f: --ffn-hidden-size, else 4h, or with --swiglu 8h/3 rounded down to a multiple of 64 (the trainer's
        default, Megatron-LM's)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def groups(self) -> int:
        """g: the key/value groups."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def key_value_size(self) -> int:
        """k = g h / a: the width of the keys (and of the values)."""
        return self.groups * (self.hidden_size // self.num_attention_heads)

    @property
    def rotary(self) -> bool:
        return self.position_embedding_type in ("rotary", "rope")

    @property
    def max_positions(self) -> int:
        """--max-position-embeddings as the trainer resolves it (the sequence length when not given)."""
        return self.seq_length if self.max_position_embeddings is None else self.max_position_embeddings

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table (0 for rotary and ALiBi, which have none)."""
        return self.max_positions if self.position_embedding_type in ("absolute", "learned") else 0


@dataclass(frozen=True)
class Layout:
    """How the run is spread over GPUs, and its precision, ZeRO stage, offload and recomputation."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    num_gpus: int = 1
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro batch x DP (one micro-batch per step)
    zero_stage: int = 0
    precision: str = "fp32"
    fp32_grad_accumulation: bool = False
    immediate_grad_update: bool = True  # DeepSpeed's bf16.immediate_grad_update (the trainer's default)
    checkpoint_activations: bool = False
    checkpoint_num_layers: int = 1
    pp_partition_method: str | None = None  # None: the trainer's default
    materialized_attention: bool = False
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    recompute_method: str = "uniform"  # full recompute's: chunks of N layers, or the first N of a stage
    recompute_modules: tuple[str, ...] = ()  # selective recompute's (the trainer's names)
    ulysses: int = 1  # S of --ds-sequence-parallel-size
    offload_optimizer: bool = False  # ds_config zero_optimization.offload_optimizer.device cpu
    offload_param: bool = False  # ds_config zero_optimization.offload_param.device cpu (ZeRO 3)

    @property
    def data_parallel(self) -> int:
        """D: the data-parallel sample streams, GPUs / (t p S)."""
        return self.num_gpus // (self.tensor_parallel * self.pipeline_parallel * self.ulysses)

    @property
    def zero_partitions(self) -> int:
        """The ranks ZeRO partitions over, D S: the weights are replicated over the Ulysses group too."""
        return self.data_parallel * self.ulysses

    @property
    def batch(self) -> int:
        """The global batch B."""
        if self.global_batch_size is None:
            return self.micro_batch_size * self.data_parallel
        return self.global_batch_size

    @property
    def micro_batches_per_step(self) -> int:
        """Gradient accumulation steps m = B / (b d)."""
        return self.batch // (self.micro_batch_size * self.data_parallel)


@dataclass(frozen=True)
class TrainingBudget:
    """A token budget and the speed assumed for it."""

    train_tokens: float | None = None
    mfu: float = 0.4
    peak_tflops: float = 989.0  # H100 SXM, dense bf16



def padded_vocab_size(shape: ModelShape, tensor_parallel: int) -> int:
    """V_p: the embedding's row count, padded as the trainer pads it (depends on TP)."""
    try:
        return vocab_size_with_padding(shape.vocab_size, shape.make_vocab_size_divisible_by, tensor_parallel,
                                       shape.pad_vocab_size_to)
    except TokenizerError as error:
        raise CalculatorError(str(error)) from None

