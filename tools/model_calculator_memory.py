"""The memory model of tools/model_calculator.py (its module docstring states the formulas): model
states per GPU (and in host memory with offload), and the activations of a pipeline stage under
each recompute mode and DeepSpeed-Ulysses."""
import math
from dataclasses import dataclass

from tools.model_calculator_inputs import Layout, ModelShape, padded_vocab_size


@dataclass(frozen=True)
class StateMemory:
    """Bytes of model states on one GPU, and in host memory per GPU with offload (``host``)."""

    weights: float
    gradients: float
    optimizer: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def bytes_per_parameter(precision: str, fp32_grad_accumulation: bool = False,
                        immediate_grad_update: bool = True) -> tuple[int, int, int]:
    """(weights, gradients, Adam states) bytes per parameter before ZeRO partitioning.

    Mixed precision: 2, 2 (+ 4 for an fp32 accumulation buffer), 12 (fp32 master, two fp32 moments).
    bf16 with fp32 accumulation and immediate_grad_update: 2, 4, 12; each bf16 gradient is added into
    its accumulator as backward produces it and dropped (that one parameter's gradient is ignored).
    fp32: 4, 4, 8 (the two moments; the weights are already the fp32 copy).
    """
    if precision == "fp32":
        return 4, 4, 8
    if not fp32_grad_accumulation:
        return 2, 2, 12
    drops_16_bit_gradients = precision == "bf16" and immediate_grad_update
    return 2, 4 if drops_16_bit_gradients else 6, 12


# DeepSpeed's ZeRO-3 defaults (zero_optimization): a parameter stays gathered when it is used again within
# stage3_max_reuse_distance gathered elements; gradients are reduced in buckets of reduce_bucket_size elements.
ZERO3_MAX_REUSE_DISTANCE = 10**9
ZERO3_REDUCE_BUCKET_SIZE = 5 * 10**8
# Under optimizer offload the GPU keeps four such buckets at ZeRO 3 (the bucket, its reduce-scatter's output and
# the reduced gradients of up to two buckets waiting for their copy to the host): 3.72 and 3.56 GiB of the 2.7B's
# and the 6.7B's measured peaks on one GPU.
ZERO3_OFFLOAD_GRADIENT_BUCKETS = 4


def zero3_gathered_parameters(largest_module: int, layer: int, layers: int) -> int:
    """Parameters ZeRO 3 holds gathered on a GPU at once: the largest module twice (the one running and
    the one prefetched) and the layers kept from their forward to their backward, floor(R / (2 P_layer))
    + 1 of a stage's ``layers`` (R = ZERO3_MAX_REUSE_DISTANCE; module docstring of model_calculator)."""
    kept = min(layers, ZERO3_MAX_REUSE_DISTANCE // (2 * layer) + 1) if layer else 0
    return 2 * largest_module + kept * layer


def model_state_bytes(parameters: int, layout: Layout, zero_stage: int | None = None,
                      gathered_parameters: int = 0) -> StateMemory:
    """Model states of a GPU holding ``parameters``: ZeRO stage z splits over its D S ranks the
    optimizer (z >= 1), the gradients (z >= 2) and the weights (z = 3; then the GPU also holds
    ``gathered_parameters`` gathered at once: ``zero3_gathered_parameters``). Offload (DeepSpeed's CPU
    Adam) moves the optimizer states and an fp32 gradient partition, 16 bytes per partitioned
    parameter, to host memory (at z = 3 DeepSpeed allocates a second one for its CPU Adam, 20 bytes;
    the trainer makes it a view of the first after set-up, yet the measured peak did not fall), and at
    z >= 2 the gradient partitions leave the GPU as they are
    reduced (at z = 3 through ZERO3_OFFLOAD_GRADIENT_BUCKETS buckets that stay); parameter offload
    (z = 3) moves the 16-bit weight partition too, leaving the gathered ones on the GPU."""
    stage = layout.zero_stage if zero_stage is None else zero_stage
    d = layout.zero_partitions
    weight, gradient, optimizer = bytes_per_parameter(layout.precision, layout.fp32_grad_accumulation,
                                                      layout.immediate_grad_update)
    weights = weight * parameters / d + weight * gathered_parameters if stage >= 3 else weight * parameters
    gradients = gradient * parameters / (d if stage >= 2 else 1)
    optimizer_states = optimizer * parameters / (d if stage >= 1 else 1)
    host = 0.0
    if layout.offload_optimizer and stage >= 1:
        host += (optimizer + (8 if stage >= 3 else 4)) * parameters / d
        optimizer_states = 0.0
        if stage >= 2:  # each partition's gradients go to the host as they are reduced
            gradients = ZERO3_OFFLOAD_GRADIENT_BUCKETS * ZERO3_REDUCE_BUCKET_SIZE * weight if stage >= 3 else 0.0
    if layout.offload_param and stage >= 3:
        host += weight * parameters / d
        weights = weight * gathered_parameters
    return StateMemory(weights=weights, gradients=gradients, optimizer=optimizer_states, host=host)


def activation_element_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _local_sequence(shape: ModelShape, layout: Layout) -> float:
    """The positions of a sequence one GPU holds outside attention: s / S under Ulysses."""
    return shape.seq_length / layout.ulysses


def _selective_savings(shape: ModelShape, layout: Layout) -> tuple[float, float, bool]:
    """Bytes per s b h that selective recompute frees (outside the TP regions, inside them / t) and
    whether it frees the materialized scores: ``layernorm`` the two norm outputs (only the first's
    when ``mlp`` keeps the second as its input), ``mlp_act`` the activation's output (f wide), ``mlp``
    the activation's input and output, ``core_attn`` the attention output (and the rotated query and
    key with rotary embeddings; the scores when materialized)."""
    modules, e, h = layout.recompute_modules, activation_element_bytes(layout.precision), shape.hidden_size
    outside = e * (1 if "mlp" in modules else 2) if "layernorm" in modules else 0.0
    mlp_width = (3 if shape.swiglu else 2) * shape.ffn
    inside = 0.0
    if "mlp" in modules:
        inside += e * mlp_width / h
    elif "mlp_act" in modules:
        inside += e * shape.ffn / h
    if "core_attn" in modules:
        inside += e * (h + (h + shape.key_value_size if shape.rotary else 0)) / h
    return outside, inside, "core_attn" in modules


def layer_activation_bytes(shape: ModelShape, layout: Layout, selective: bool = True) -> float:
    """Bytes one layer keeps for the backward, per micro-batch (Korthikanti et al. 2022), over the
    s' = s / S positions of the GPU: s' b h (4e + 2) outside the TP regions (two LayerNorm inputs,
    the QKV and MLP inputs, two 1-byte dropout masks), replicated over TP, or split (/ t) by
    sequence parallelism, + s' b h (4e + 2ef/h) / t split (Q, K, V, attention output, GeLU input and
    output; K and V are k wide, not h, and SwiGLU keeps its 2f input and f product, 3ef/h) [+ 2 e s'
    b h (1 - 1/t) with --tp-comm-overlap, which keeps the QKV and MLP inputs gathered] [+ (2e + 1) a
    s^2 b / (t S): softmax output, its dropout mask and output, when materialized; Ulysses runs a / S
    heads at full length]; less what selective recompute frees (``_selective_savings``, unless
    ``selective`` is False: a layer that full recompute runs again keeps everything). At e = 2,
    f = 4h: s b h (10 + 24/t + 5as/(ht)), and with sequence parallelism s b h / t (34 + 5as/h)."""
    s, b, h = _local_sequence(shape, layout), layout.micro_batch_size, shape.hidden_size
    e, t = activation_element_bytes(layout.precision), layout.tensor_parallel
    freed_outside, freed_inside, frees_scores = _selective_savings(shape, layout) if selective else (0.0, 0.0, False)
    outside_tp = (4 * e + 2 - freed_outside) / (t if layout.sequence_parallel else 1)
    mlp = (3 if shape.swiglu else 2) * shape.ffn
    inside_tp = (e * (2 * h + 2 * shape.key_value_size + mlp) / h - freed_inside) / t
    gathered_inputs = 2 * e * (1 - 1 / t) if layout.tp_comm_overlap else 0.0
    scores = 0.0
    if layout.materialized_attention and not frees_scores:
        scores = (2 * e + 1) * shape.num_attention_heads * shape.seq_length ** 2 * b / (t * layout.ulysses)
    return s * b * h * (outside_tp + inside_tp + gathered_inputs) + scores


def layer_input_bytes(shape: ModelShape, layout: Layout) -> float:
    """e s' b h: the input a checkpointed chunk keeps; / t under sequence parallelism (the rank's block)."""
    sequence = _local_sequence(shape, layout) / (layout.tensor_parallel if layout.sequence_parallel else 1)
    return activation_element_bytes(layout.precision) * sequence * layout.micro_batch_size * shape.hidden_size


def logits_activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """2 e s' b V_p / t at the loss (last stage): the logits, which the GPU's fused cross entropy keeps for
    the backward (it computes in fp32 without a working copy), and their gradient."""
    vocab = padded_vocab_size(shape, layout.tensor_parallel)
    element = activation_element_bytes(layout.precision)
    return 2 * element * _local_sequence(shape, layout) * layout.micro_batch_size * vocab / layout.tensor_parallel


def micro_batches_in_flight(layout: Layout, stage: int) -> int:
    """1F1B: stage i has run forward on min(p - i, m) micro-batches before its first backward."""
    return min(layout.pipeline_parallel - stage, layout.micro_batches_per_step)


@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes of one GPU of a pipeline stage (estimate)."""

    per_micro_batch: float  # what one micro-batch leaves for the backward
    in_flight: int  # micro-batches whose activations are held at once
    recompute: float  # one checkpointed chunk rebuilt in the backward (0 without checkpointing)
    logits: float  # the last stage's fp32 logits at the loss (0 elsewhere)

    @property
    def total(self) -> float:
        return self.in_flight * self.per_micro_batch + self.recompute + self.logits


def stage_activation_bytes(shape: ModelShape, layout: Layout, stage: int, layers: int) -> ActivationMemory:
    """Activations of a stage with ``layers`` layers. Full recompute, uniform: each chunk of N
    (--recompute-num-layers) layers keeps its input and one chunk is rebuilt at a time; block: the
    first N layers keep their inputs (one rebuilt at a time), the others everything. Selective
    recompute frees its modules' share in every layer, or with block in the first N only."""
    full_layer = layer_activation_bytes(shape, layout, selective=False)
    logits = logits_activation_bytes(shape, layout) if stage == layout.pipeline_parallel - 1 else 0.0
    in_flight = micro_batches_in_flight(layout, stage)
    if not layout.checkpoint_activations:
        selective = min(layout.checkpoint_num_layers, layers) if layout.recompute_method == "block" else layers
        kept = selective * layer_activation_bytes(shape, layout) + (layers - selective) * full_layer
        return ActivationMemory(per_micro_batch=kept, in_flight=in_flight, recompute=0.0, logits=logits)
    if layout.recompute_method == "block":
        recomputed = min(layout.checkpoint_num_layers, layers)
        kept = recomputed * layer_input_bytes(shape, layout) + (layers - recomputed) * full_layer
        return ActivationMemory(per_micro_batch=kept, in_flight=in_flight,
                                recompute=full_layer if recomputed else 0.0, logits=logits)
    chunk = min(layout.checkpoint_num_layers, layers)
    return ActivationMemory(per_micro_batch=math.ceil(layers / chunk) * layer_input_bytes(shape, layout),
                            in_flight=in_flight, recompute=chunk * full_layer, logits=logits)
