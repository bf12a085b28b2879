"""Size a GPT pretraining run before launching it: parameters, memory per GPU, FLOPs and training time.

Takes pretrain_gpt.py's model flags and a parallel layout, and prints (docs/model_calculator.md has
the derivations). Notation: L layers, h hidden, a heads, f = ffn hidden size (default 4h; 8h/3
rounded down to a multiple of 64 with --swiglu, as the trainer), s sequence length, V_p padded
vocabulary, t = TP, p = PP, d = DP = GPUs / (t p), b micro batch, B global batch, e = bytes of an
activation element (2 in fp16/bf16, 4 in fp32). Llama-class options: g key/value groups (grouped-
query attention, default a), k = g h / a the width of the keys and of the values, u = 2 with a
SwiGLU MLP (its first matmul is twice as wide) else 1, RMSNorm (no bias), no biases
(--disable-bias-linear, --add-qkv-bias puts the QKV one back), an untied output layer.

Parameters (exact): counted on the trainer's own pipeline layers (GPTModelPipe's list, built on the
meta device, so no memory is taken), with V_p = V rounded up to a multiple of
--make-vocab-size-divisible-by x t as the trainer pads it. On one GPU a tensor the layers mark as
split over TP counts 1/t, the others (row-parallel biases, LayerNorms, the position table) whole:
    layer     4h^2 + 2hf + 9h + f             (QKV, output projection, two MLP matmuls, their biases,
                                               two LayerNorms); in general
              h(h + 2k) + h^2 + (u + 1)hf     the matmuls: QKV (a + 2g) h/a x h, output, MLP
              + (h + 2k) + h + uf + h         the biases (the QKV one alone with --add-qkv-bias)
              + 4h (LayerNorm) or 2h (RMSNorm)
    per GPU   (4h^2 + 2hf + 3h + f)/t + 6h
    model     L layer + V_p h [+ s_max h learned positions] [+ 2h embedding LayerNorm] + 2h final
              LayerNorm (h RMSNorm) [+ V_p h untied output layer]
The stages are the trainer's split (``stage_boundaries`` with --pp-partition-method, by default
type:transformer: the first L mod p stages get one layer more; "flops" weighs the output layer's 2hV
against each layer's FLOPs, so the last stage gets fewer layers); the first holds the embeddings, the
last the final LayerNorm and the output layer (tied: a copy of the embedding module, as DeepSpeed's
tied layers do).

Model states per GPU, for P parameters on the GPU (ZeRO, Rajbhandari et al. 2020): weights 2P (4P
in fp32), gradients 2P (4P in fp32; + 4P with fp32 gradient accumulation, or that 4P alone with
bf16's immediate_grad_update, the trainer's default), Adam 12P (fp32 master copy and two moments; 8P
in fp32). ZeRO 1 divides the optimizer states by d S (S: Ulysses' sequence-parallel size, 1
without), 2 the gradients too, 3 the weights too, and ZeRO 3 adds the gathered weights: two modules
(the one running, the one prefetched; the largest module counts: a layer, the embedding or the
output layer) and the layers DeepSpeed keeps gathered from their forward to their backward, those
whose weights come back within stage3_max_reuse_distance = 1e9 gathered elements: after layer i of
L, 2 (L - 1 - i) P_layer elements are gathered before its backward, so floor(1e9 / (2 P_layer)) + 1
layers. Offload: --offload-optimizer puts Adam's states and an fp32 gradient partition, 16P/(d S),
in host memory (at ZeRO 3 DeepSpeed allocates a second fp32 gradient partition for its CPU Adam,
20P/(d S); the trainer makes it a view of the first after set-up, yet the measured peak did not fall;
at ZeRO 2 and 3 no gradient partition stays on the GPU, but at ZeRO 3 four reduce_bucket_size = 5e8-element buffers in
the weights' dtype do: the bucket, its reduce-scatter's output and the reduced gradients of up to two
buckets waiting for their copy to the host);
--offload-param (ZeRO 3) the 2P/(d S) weight partition, leaving only the gathered weights.

Activations of one layer and micro-batch (estimate, Korthikanti et al. 2022), with e = 2, f = 4h:
s b h (10 + 24/t) bytes, s b h (34/t) with --sequence-parallel, + 2 e s b h (1 - 1/t) with
--tp-comm-overlap (the QKV and first MLP inputs kept gathered); + 5 a s^2 b / t when the attention
scores are materialized (the trainer's --deterministic; its default fused attention keeps none).
With full checkpointing a layer keeps only its input (e s b h, / t with sequence parallelism) and
one chunk is recomputed at a time; --recompute-method block checkpoints the first N layers of a
stage only, the others keep everything. Selective recompute frees what its modules recompute (with
--recompute-method block in the first N layers of a stage only): per
s b h, layernorm the two norms' outputs (2e; e when mlp keeps the second), mlp_act the
activation's output (e f/h / t), mlp its input and output (e (u + 1) f/h / t), core_attn the
attention output (e / t; with rotary embeddings also the rotated query and key, e (h + k)/h / t;
and the scores when materialized). Ulysses (--ds-sequence-parallel-size S) holds s/S positions per
GPU: every term above with s/S, the scores with a/S heads at full length. 1F1B keeps
min(p - stage, micro-batches per step) micro-batches in flight. The last stage adds 2 e s b V_p / t
at the loss (the logits, which the fused cross entropy keeps for the backward, and their gradient).

FLOPs per iteration (Narayanan et al. 2021; Megatron-LM's count with grouped-query attention and
a GLU, megatron.core.flops), matmuls only, l = 4h^2 + 4hk + 4sh + 2(u + 1)hf per layer and token
(8h^2 + 4sh + 4hf without the Llama-class options):
    model     F = 3 B s [L l + 2hV_p]                    = 72 B s L h^2 (1 + s/6h + V_p/12Lh) at f = 4h
    hardware  with full recomputation the layers run a second forward:
              4 B s L l + 6 B s h V_p                    = 96 B s L h^2 (1 + s/6h + V_p/16Lh) at f = 4h
              and this run's: B s [(3 + r) L l + 6 h V_p] with r the layers' recomputed share (1 full
              uniform, N p / L block, the recomputed modules' matmuls selective: the trainer's count)
    days      tokens x (F / B s) / (GPUs x peak x MFU) / 86400
"""
import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.flops import layer_forward_flops_per_token, output_layer_forward_flops_per_token  # noqa: E402
from megatron.core.flops import model_flops_per_iteration as core_model_flops  # noqa: E402
from megatron.training.argument_groups import add_llama_args, add_recompute_args  # noqa: E402
from megatron.training.argument_types import ArgumentError, parse_float, parse_int  # noqa: E402
from megatron.training.recompute_flags import recompute_settings  # noqa: E402
from megatron.training.throughput import recomputed_fraction  # noqa: E402
from tools.model_calculator_inputs import (NORMALIZATIONS, POSITION_EMBEDDING_TYPES, PRECISIONS,  # noqa: E402
                                           RECOMPUTE_METHODS, ZERO_STAGES, CalculatorError, Layout, ModelShape,
                                           TrainingBudget, padded_vocab_size)
from tools.model_calculator_memory import (layer_activation_bytes, model_state_bytes, zero3_gathered_parameters,  # noqa: E402
                                           stage_activation_bytes)
from tools.model_calculator_report import format_report  # noqa: E402

SECONDS_PER_DAY = 86400.0


# ------------------------------------------------------------------------------------------ checks


def _require_positive(values: dict[str, int | None]) -> None:
    for flag, value in values.items():
        if value is not None and value < 1:
            raise CalculatorError(f"{flag} must be a positive integer, got {value}")


def check_model(shape: ModelShape) -> None:
    """Raise CalculatorError naming the flag if ``shape`` describes no valid GPT."""
    _require_positive({"--num-layers": shape.num_layers, "--hidden-size": shape.hidden_size,
                       "--num-attention-heads": shape.num_attention_heads, "--seq-length": shape.seq_length,
                       "--max-position-embeddings": shape.max_position_embeddings,
                       "--vocab-size": shape.vocab_size, "--ffn-hidden-size": shape.ffn_hidden_size,
                       "--num-query-groups": shape.num_query_groups})
    if shape.hidden_size % shape.num_attention_heads:
        raise CalculatorError(f"--num-attention-heads {shape.num_attention_heads} does not divide "
                              f"--hidden-size {shape.hidden_size}")
    if shape.num_attention_heads % shape.groups:
        raise CalculatorError(f"--num-query-groups {shape.groups} does not divide --num-attention-heads "
                              f"{shape.num_attention_heads}: each key/value group serves the same number of heads")
    if shape.normalization not in NORMALIZATIONS:
        raise CalculatorError(f"--normalization {shape.normalization!r}: use one of {', '.join(NORMALIZATIONS)}")
    if shape.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise CalculatorError(f"--position-embedding-type {shape.position_embedding_type!r}: use one of "
                              f"{', '.join(POSITION_EMBEDDING_TYPES)}")
    if shape.position_rows and shape.position_rows < shape.seq_length:
        raise CalculatorError(f"--max-position-embeddings {shape.position_rows} is smaller than --seq-length "
                              f"{shape.seq_length}: the position table needs a row per position")


def _check_parallel_sizes(shape: ModelShape, layout: Layout) -> None:
    t, p = layout.tensor_parallel, layout.pipeline_parallel
    _require_positive({"--tensor-model-parallel-size": t, "--pipeline-model-parallel-size": p,
                       "--num-gpus": layout.num_gpus, "--micro-batch-size": layout.micro_batch_size,
                       "--global-batch-size": layout.global_batch_size,
                       "--checkpoint-num-layers": layout.checkpoint_num_layers})
    if shape.num_attention_heads % t:
        raise CalculatorError(f"--tensor-model-parallel-size {t} does not divide --num-attention-heads "
                              f"{shape.num_attention_heads}: each TP rank needs whole heads")
    if shape.groups % t:
        raise CalculatorError(f"--tensor-model-parallel-size {t} does not divide --num-query-groups {shape.groups}: "
                              f"each TP rank needs whole key/value groups")
    if shape.ffn % t:
        raise CalculatorError(f"--tensor-model-parallel-size {t} does not divide the MLP size {shape.ffn} "
                              f"(--ffn-hidden-size, default 4 x --hidden-size)")
    if p > shape.num_layers:
        raise CalculatorError(f"--pipeline-model-parallel-size {p} is more than --num-layers {shape.num_layers}: "
                              f"every stage needs a layer")
    if layout.num_gpus % (t * p):
        raise CalculatorError(f"--num-gpus {layout.num_gpus} is not a multiple of --tensor-model-parallel-size "
                              f"{t} x --pipeline-model-parallel-size {p} = {t * p}")


def _check_sequence_parallel(shape: ModelShape, layout: Layout) -> None:
    if layout.tp_comm_overlap and not layout.sequence_parallel:
        raise CalculatorError("--tp-comm-overlap pipelines the all-gathers and reduce-scatters of sequence "
                              "parallelism with their GEMMs: add --sequence-parallel (with TP > 1)")
    if layout.sequence_parallel and shape.seq_length % layout.tensor_parallel:
        raise CalculatorError(f"--tensor-model-parallel-size {layout.tensor_parallel} does not divide --seq-length "
                              f"{shape.seq_length}: --sequence-parallel splits the sequence over the TP ranks")


def _check_ulysses(shape: ModelShape, layout: Layout) -> None:
    """The trainer's rules for --ds-sequence-parallel-size S."""
    t, sp = layout.tensor_parallel, layout.ulysses
    if sp == 1:
        return
    for name, count in (("--num-attention-heads", shape.num_attention_heads), ("--num-query-groups", shape.groups)):
        if (count // t) % sp:
            raise CalculatorError(f"--ds-sequence-parallel-size {sp} does not divide {name} {count} / TP {t}: each "
                                  f"sequence-parallel rank attends over 1 / S of a TP rank's heads")
    split = sp * (t if layout.sequence_parallel else 1)
    if shape.seq_length % split:
        raise CalculatorError(f"--ds-sequence-parallel-size {sp}{' x TP ' + str(t) if layout.sequence_parallel else ''}"
                              f" does not divide --seq-length {shape.seq_length}")
    if layout.num_gpus % (t * layout.pipeline_parallel * sp):
        raise CalculatorError(f"--num-gpus {layout.num_gpus} is not a multiple of TP {t} x PP "
                              f"{layout.pipeline_parallel} x --ds-sequence-parallel-size {sp}")


def _check_offload_and_recompute(layout: Layout) -> None:
    if layout.offload_param and layout.zero_stage != 3:
        raise CalculatorError("--offload-param moves ZeRO 3's weight partitions to the host: add --zero-stage 3")
    if layout.offload_optimizer and layout.zero_stage == 0:
        raise CalculatorError("--offload-optimizer runs ZeRO's optimizer partitions on the host: add --zero-stage "
                              "1, 2 or 3")
    if layout.recompute_method not in RECOMPUTE_METHODS:
        raise CalculatorError(f"--recompute-method {layout.recompute_method!r}: use one of "
                              f"{', '.join(RECOMPUTE_METHODS)}")


def check_layout(shape: ModelShape, layout: Layout) -> None:
    """Raise CalculatorError naming the flag if ``layout`` cannot run ``shape``."""
    _check_parallel_sizes(shape, layout)
    _check_sequence_parallel(shape, layout)
    _check_ulysses(shape, layout)
    _check_offload_and_recompute(layout)
    per_step = layout.micro_batch_size * layout.data_parallel
    if layout.batch % per_step:
        raise CalculatorError(f"--global-batch-size {layout.batch} is not a multiple of --micro-batch-size "
                              f"{layout.micro_batch_size} x data-parallel size {layout.data_parallel} = {per_step}")
    if layout.zero_stage not in ZERO_STAGES:
        raise CalculatorError(f"--zero-stage {layout.zero_stage}: use one of {ZERO_STAGES}")
    if layout.zero_stage >= 2 and layout.pipeline_parallel > 1:
        raise CalculatorError(f"--zero-stage {layout.zero_stage} with --pipeline-model-parallel-size "
                              f"{layout.pipeline_parallel}: DeepSpeed's pipeline engine runs ZeRO stage 0 or 1")
    if layout.precision not in PRECISIONS:
        raise CalculatorError(f"precision {layout.precision!r}: use --fp16, --bf16 or neither (fp32)")


def check_budget(budget: TrainingBudget) -> None:
    """Raise CalculatorError naming the flag if the budget's figures are out of range."""
    if budget.train_tokens is not None and budget.train_tokens <= 0:
        raise CalculatorError(f"--train-tokens must be positive, got {budget.train_tokens:g}")
    if not 0 < budget.mfu <= 1:
        raise CalculatorError(f"--mfu is a fraction in (0, 1], got {budget.mfu:g}")
    if budget.peak_tflops <= 0:
        raise CalculatorError(f"--peak-tflops must be positive, got {budget.peak_tflops:g}")


# ------------------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts; ``per_gpu`` has one entry per pipeline stage (any TP rank of it)."""

    total: int
    without_embeddings: int
    word_embeddings: int
    position_embeddings: int
    output_layer: int
    layers_per_stage: list[int]
    per_gpu: list[int]
    largest_module_per_gpu: int  # the most one module (a layer, the embedding, the head) holds on a GPU
    layer_per_gpu: int  # one transformer layer's parameters on a GPU


def model_config(shape: ModelShape, tensor_parallel: int):
    """The trainer's GPTModelConfig of ``shape`` at TP ``tensor_parallel`` (whose padding sets V_p), checked
    as the trainer checks it for that TP size."""
    from megatron.core.models.gpt.config import GPTConfigError, GPTModelConfig
    from megatron.core.parallel_state import ParallelConfigError

    positions = {"learned": "absolute", "rope": "rotary"}.get(shape.position_embedding_type,
                                                              shape.position_embedding_type)
    try:
        config = GPTModelConfig(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_attention_heads, seq_length=shape.seq_length,
            padded_vocab_size=padded_vocab_size(shape, tensor_parallel), ffn_hidden_size=shape.ffn,
            max_position_embeddings=None if positions == "rotary" else shape.max_positions,
            position_embedding_type=positions, embed_layernorm=shape.embed_layernorm,
            normalization=shape.normalization, num_query_groups=shape.groups,
            glu_activation="swiglu" if shape.swiglu else None, bias_gelu_fusion=not shape.swiglu,
            add_bias_linear=shape.add_bias_linear, add_qkv_bias=shape.add_qkv_bias,
            untie_embeddings_and_output_weights=shape.untie_embeddings_and_output_weights,
            rotary_base=shape.rotary_base, rotary_percent=shape.rotary_percent)
        config.validate_for_tensor_parallel(tensor_parallel)
    except (GPTConfigError, ParallelConfigError) as error:
        raise CalculatorError(str(error)) from None
    return config


@contextlib.contextmanager
def _initialisation_stream():
    """The model-parallel RNG stream the layers' initialisation forks to (it draws nothing on the meta
    device); the process's tracker is left as it was."""
    from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker

    tracker = get_rng_tracker()
    saved = tracker.get_states()
    if MODEL_PARALLEL_RNG in saved:
        yield
        return
    tracker.add(MODEL_PARALLEL_RNG, 0)
    try:
        yield
    finally:
        tracker.reset()
        tracker.set_states(saved)


def pipeline_stages(shape: ModelShape, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    partition_method: str | None = None) -> list[list]:
    """The trainer's pipeline layer list (GPTModelPipe's specs, built on the meta device: shapes
    without memory), split into stages by the trainer's own rule (``stage_boundaries`` with
    --pp-partition-method ``partition_method``, default the trainer's)."""
    from megatron.training.initialize import select_accelerator

    select_accelerator()  # before DeepSpeed's import, which otherwise announces its CPU fallback on stdout
    from megatron.core.parallel_state import single_rank_groups
    from megatron.training.config import DEFAULT_PP_PARTITION_METHOD
    from megatron.training.engine.pipeline_module import gpt_layer_specs, stage_boundaries

    specs = gpt_layer_specs(model_config(shape, tensor_parallel), single_rank_groups(), device="meta")
    try:
        with _initialisation_stream():  # "parameters" builds each layer to count it
            bounds = stage_boundaries(specs, pipeline_parallel, partition_method or DEFAULT_PP_PARTITION_METHOD)
    except ValueError as error:
        raise CalculatorError(str(error)) from None
    return [specs[bounds[stage]:bounds[stage + 1]] for stage in range(pipeline_parallel)]


def _is_transformer_layer(spec) -> bool:
    return getattr(spec, "typename", None) is not None and spec.typename.__name__ == "ParallelTransformerLayerPipe"


def layers_per_stage(shape: ModelShape, pipeline_parallel: int, partition_method: str | None = None) -> list[int]:
    """Transformer layers of each pipeline stage, as the trainer splits them."""
    return [sum(map(_is_transformer_layer, stage))
            for stage in pipeline_stages(shape, 1, pipeline_parallel, partition_method)]


class _BuiltLayers:
    """One module per layer class of the spec list, built on first use: the copies of a class have one
    shape (the transformer layers differ only in their number; the tied embedding is one module)."""

    def __init__(self):
        self.modules = {}

    def __call__(self, spec):
        name = spec.typename.__name__
        if name not in self.modules:
            with _initialisation_stream():
                self.modules[name] = spec.build()
        return self.modules[name]


def _per_gpu(module, tensor_parallel: int) -> int:
    """Parameters of ``module`` on one GPU: a tensor the layers mark as split over TP counts 1/t."""
    return sum(p.numel() // tensor_parallel if getattr(p, "tensor_model_parallel", False) else p.numel()
               for p in module.parameters())


def _stage_parameters_per_gpu(stage: list, build: _BuiltLayers, tensor_parallel: int) -> int:
    """A stage's parameters on one GPU: each module once (a tied module is one per stage, as DeepSpeed
    builds it: the tied head of the last stage is a copy of the embedding module)."""
    count, tied_counted = 0, False
    for spec in stage:
        if not hasattr(spec, "build"):
            continue  # a function: no parameters
        if hasattr(spec, "key"):  # the tied embedding
            if not tied_counted:
                count += _per_gpu(build(spec), tensor_parallel)
                tied_counted = True
        else:
            count += _per_gpu(build(spec), tensor_parallel)
    return count


def count_parameters(shape: ModelShape, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                     partition_method: str | None = None) -> ParameterCounts:
    """Parameters of the model (each counted once) and of one GPU of each pipeline stage, counted on the
    trainer's layers (the untied output layer among them)."""
    stages = pipeline_stages(shape, tensor_parallel, pipeline_parallel, partition_method)
    build = _BuiltLayers()
    specs = [spec for stage in stages for spec in stage if hasattr(spec, "build")]
    embedding = build(next(spec for spec in specs if hasattr(spec, "key")))
    word = embedding.word_embeddings.weight.numel()
    position = 0 if embedding.position_embeddings is None else embedding.position_embeddings.weight.numel()
    output = sum(build(spec).weight.numel() for spec in specs if spec.typename.__name__ == "OutputLayerPipe")
    unique = [build(spec) for spec in specs if not hasattr(spec, "key")] + [embedding]
    total = sum(p.numel() for module in unique for p in module.parameters())
    per_gpu = [_stage_parameters_per_gpu(stage, build, tensor_parallel) for stage in stages]
    largest = max(_per_gpu(build(spec), tensor_parallel) for spec in specs)
    layer = next((_per_gpu(build(spec), tensor_parallel) for spec in specs if _is_transformer_layer(spec)), 0)
    return ParameterCounts(total=total, without_embeddings=total - word - position - output, word_embeddings=word,
                           position_embeddings=position, output_layer=output,
                           layers_per_stage=[sum(map(_is_transformer_layer, stage)) for stage in stages],
                           per_gpu=per_gpu, largest_module_per_gpu=largest, layer_per_gpu=layer)


# ------------------------------------------------------------------------------------------ FLOPs and time


def model_flops_per_iteration(shape: ModelShape, layout: Layout) -> float:
    """F = 3 B s [L l + 2hV_p] (module docstring): forward + backward (twice the forward), no recomputation;
    the trainer's count (megatron.core.flops), which its model TFLOP/s and MFU use."""
    return core_model_flops(global_batch_size=layout.batch, seq_length=shape.seq_length,
                            num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                            padded_vocab_size=padded_vocab_size(shape, layout.tensor_parallel),
                            ffn_hidden_size=shape.ffn, glu=shape.swiglu, key_value_size=shape.key_value_size)


def hardware_flops_with_recompute(shape: ModelShape, layout: Layout) -> float:
    """4 B s L l + 6 B s h V_p: full recomputation adds one forward of the layers (the output layer is
    not recomputed); 96 B s L h^2 (1 + s/6h + V_p/16Lh) at f = 4h (Narayanan et al. 2021)."""
    tokens = layout.batch * shape.seq_length
    logits = output_layer_forward_flops_per_token(shape.hidden_size, padded_vocab_size(shape, layout.tensor_parallel))
    layer = layer_forward_flops_per_token(shape.hidden_size, shape.seq_length, shape.ffn, glu=shape.swiglu,
                                          key_value_size=shape.key_value_size)
    return tokens * (4.0 * shape.num_layers * layer + 3.0 * logits)


def recomputed_share(shape: ModelShape, layout: Layout) -> float:
    """r: the share of the layers' forward matmul FLOPs that the run's recompute mode runs again (the
    trainer's ``throughput.recomputed_fraction``: 1 full uniform, N p / L block, the recomputed
    modules' share selective)."""
    from megatron.core.models.gpt.config import GPTConfigError

    try:
        config = replace(model_config(shape, layout.tensor_parallel),
                         checkpoint_activations=layout.checkpoint_activations,
                         checkpoint_num_layers=layout.checkpoint_num_layers, recompute_method=layout.recompute_method,
                         recompute_modules=layout.recompute_modules)
    except GPTConfigError as error:
        raise CalculatorError(str(error)) from None
    return recomputed_fraction(config, layout.pipeline_parallel)


def this_run_hardware_flops(shape: ModelShape, layout: Layout) -> float:
    """B s [(3 + r) L l + 3 (2hV_p)]: the layers' recomputed share r runs a fourth pass."""
    tokens = layout.batch * shape.seq_length
    logits = output_layer_forward_flops_per_token(shape.hidden_size, padded_vocab_size(shape, layout.tensor_parallel))
    layer = layer_forward_flops_per_token(shape.hidden_size, shape.seq_length, shape.ffn, glu=shape.swiglu,
                                          key_value_size=shape.key_value_size)
    return tokens * ((3.0 + recomputed_share(shape, layout)) * shape.num_layers * layer + 3.0 * logits)


def training_days(model_flops_per_token: float, budget: TrainingBudget, num_gpus: int) -> float:
    """tokens x FLOPs per token / (GPUs x peak x MFU), in days."""
    cluster_flops_per_second = num_gpus * budget.peak_tflops * 1e12 * budget.mfu
    return budget.train_tokens * model_flops_per_token / cluster_flops_per_second / SECONDS_PER_DAY


# ------------------------------------------------------------------------------------------ the report


def _memory_figures(shape: ModelShape, layout: Layout, counts: ParameterCounts) -> list[dict]:
    """Per pipeline stage: activations and model states at every ZeRO stage, in bytes (ZeRO 3's gathered
    weights: ``zero3_gathered_parameters``)."""
    stages = []
    for stage, (layers, parameters) in enumerate(zip(counts.layers_per_stage, counts.per_gpu)):
        activations = stage_activation_bytes(shape, layout, stage, layers)
        by_zero = {}
        for zero in ZERO_STAGES:
            gathered = zero3_gathered_parameters(counts.largest_module_per_gpu, counts.layer_per_gpu, layers)
            states = model_state_bytes(parameters, layout, zero, gathered_parameters=gathered)
            by_zero[str(zero)] = {**asdict(states), "activations": activations.total,
                                  "total": states.total + activations.total}
        stages.append({"stage": stage, "layers": layers, "parameters_per_gpu": parameters,
                       "activations": {**asdict(activations), "total": activations.total},
                       "by_zero_stage": by_zero})
    return stages


def _flops_figures(shape: ModelShape, layout: Layout, budget: TrainingBudget) -> dict:
    model = model_flops_per_iteration(shape, layout)
    hardware = hardware_flops_with_recompute(shape, layout)
    tokens = layout.batch * shape.seq_length
    figures = {"tokens_per_iteration": tokens, "model_flops_per_iteration": model,
               "hardware_flops_per_iteration_with_recompute": hardware, "model_flops_per_token": model / tokens,
               "this_run_hardware_flops_per_iteration": this_run_hardware_flops(shape, layout)}
    if budget.train_tokens is not None:
        figures["training"] = {"train_tokens": budget.train_tokens, "mfu": budget.mfu,
                               "peak_tflops": budget.peak_tflops,
                               "iterations": math.ceil(budget.train_tokens / tokens),
                               "tokens_per_second": layout.num_gpus * budget.peak_tflops * 1e12 * budget.mfu
                               / (model / tokens),
                               "days": training_days(model / tokens, budget, layout.num_gpus)}
    return figures


def calculate(shape: ModelShape, layout: Layout, budget: TrainingBudget = TrainingBudget()) -> dict:
    """Every figure of the report (bytes, FLOPs, counts), after checking the flags."""
    check_model(shape)
    check_layout(shape, layout)
    check_budget(budget)
    counts = count_parameters(shape, layout.tensor_parallel, layout.pipeline_parallel, layout.pp_partition_method)
    return {"model": {**asdict(shape), "max_position_embeddings": shape.max_positions, "ffn_hidden_size": shape.ffn,
                      "num_query_groups": shape.groups, "key_value_size": shape.key_value_size,
                      "position_table_rows": shape.position_rows,
                      "padded_vocab_size": padded_vocab_size(shape, layout.tensor_parallel)},
            "layout": {**asdict(layout), "data_parallel": layout.data_parallel, "global_batch_size": layout.batch,
                       "micro_batches_per_step": layout.micro_batches_per_step,
                       "zero_partitions": layout.zero_partitions},
            "parameters": asdict(counts),
            "memory_per_gpu": {"activation_bytes_per_layer": layer_activation_bytes(shape, layout),
                               "stages": _memory_figures(shape, layout, counts)},
            "flops": _flops_figures(shape, layout, budget)}


# ------------------------------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Parameters, memory per GPU, FLOPs and training time of a GPT run "
                                     "(docs/model_calculator.md).", allow_abbrev=False)
    model = parser.add_argument_group("model (pretrain_gpt.py's flags)")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        model.add_argument(flag, type=parse_int, required=True)
    model.add_argument("--max-position-embeddings", type=parse_int, default=None,
                       help="rows of the learned position table (default --seq-length)")
    model.add_argument("--vocab-size", type=parse_int, default=50257, help="tokenizer vocabulary (GPT-2: 50257)")
    model.add_argument("--make-vocab-size-divisible-by", type=parse_int, default=128)
    model.add_argument("--pad-vocab-size-to", type=parse_int, default=None)
    model.add_argument("--ffn-hidden-size", type=parse_int, default=None, help="MLP inner size (default 4h)")
    model.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default="absolute",
                       help="absolute (= learned) adds a position table; rotary and alibi have none")
    model.add_argument("--embed-layernorm", action="store_true", help="LayerNorm after the word embeddings (BLOOM)")
    add_llama_args(model)  # the trainer's Llama-class flags; the rotary base and rope scaling change no figure
    layout = parser.add_argument_group("layout")
    layout.add_argument("--tensor-model-parallel-size", type=parse_int, default=1)
    layout.add_argument("--pipeline-model-parallel-size", type=parse_int, default=1)
    layout.add_argument("--pp-partition-method", default=None,
                        help="the trainer's stage split: type:transformer (default), flops, parameters, uniform")
    layout.add_argument("--num-gpus", type=parse_int, default=None, help="world size (default TP x PP)")
    layout.add_argument("--micro-batch-size", type=parse_int, default=1)
    layout.add_argument("--global-batch-size", type=parse_int, default=None, help="default micro batch x DP")
    layout.add_argument("--zero-stage", type=parse_int, default=0, help="0, 1, 2 or 3")
    precision = layout.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--bf16", action="store_true")
    layout.add_argument("--grad-accum-dtype", choices=PRECISIONS, default=None,
                        help="ds_config data_types.grad_accum_dtype (the trainer's default: fp32 with --bf16)")
    layout.add_argument("--no-immediate-grad-update", dest="immediate_grad_update", action="store_false",
                        help="ds_config bf16.immediate_grad_update false: bf16 gradients are kept beside their fp32 "
                             "accumulators until the step (the trainer's default is true)")
    layout.add_argument("--sequence-parallel", action="store_true",
                        help="split the activations outside the TP regions along the sequence (no effect at TP 1)")
    layout.add_argument("--tp-comm-overlap", action="store_true",
                        help="with --sequence-parallel, keep each column-parallel GEMM's gathered input")
    layout.add_argument("--ds-sequence-parallel-size", type=parse_int, default=1,
                        help="DeepSpeed-Ulysses: S ranks share each sequence (1/S of its positions each)")
    layout.add_argument("--offload-optimizer", action="store_true",
                        help="ds_config zero_optimization.offload_optimizer.device cpu: Adam on the host")
    layout.add_argument("--offload-param", action="store_true",
                        help="ds_config zero_optimization.offload_param.device cpu (ZeRO 3): weights on the host")
    layout.add_argument("--checkpoint-activations", action="store_true", help="full activation recomputation")
    layout.add_argument("--checkpoint-num-layers", type=parse_int, default=1, help="layers per checkpointed chunk")
    layout.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                        help="as the trainer (selective recompute then keeps the norms' outputs)")
    add_recompute_args(layout)  # the trainer's Megatron-LM recompute flags
    layout.add_argument("--deterministic", action="store_true",
                        help="the trainer's materialized attention, which keeps the [b, a, s, s] scores")
    budget = parser.add_argument_group("training time")
    budget.add_argument("--train-tokens", type=parse_float, default=None, help="token budget, e.g. 300e9")
    budget.add_argument("--mfu", type=parse_float, default=0.4, help="model FLOPs utilization (default 0.4)")
    budget.add_argument("--peak-tflops", type=parse_float, default=989.0,
                        help="peak TFLOP/s per GPU (default 989: H100 SXM dense bf16)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def _query_groups(args: argparse.Namespace) -> int | None:
    """g from --num-key-value-heads, or --group-query-attention --num-query-groups (as the trainer reads them)."""
    if args.num_key_value_heads is not None:
        return args.num_key_value_heads
    if args.group_query_attention != (args.num_query_groups is not None):
        raise CalculatorError("--group-query-attention and --num-query-groups G go together: give both")
    return args.num_query_groups


def fp32_grad_accumulation(precision: str, grad_accum_dtype: str | None) -> bool:
    """Whether a 16-bit run adds an fp32 gradient buffer: by default with bf16 (as the trainer sets it)."""
    accumulate = grad_accum_dtype or ("fp32" if precision == "bf16" else precision)
    if accumulate not in ("fp32", precision):
        raise CalculatorError(f"--grad-accum-dtype {accumulate} with {precision} training: use fp32 or {precision}")
    return precision != "fp32" and accumulate == "fp32"


def inputs_from_args(args: argparse.Namespace) -> tuple[ModelShape, Layout, TrainingBudget]:
    shape = ModelShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings, vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, pad_vocab_size_to=args.pad_vocab_size_to,
        ffn_hidden_size=args.ffn_hidden_size, position_embedding_type=args.position_embedding_type,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        embed_layernorm=args.embed_layernorm, normalization=args.normalization, num_query_groups=_query_groups(args),
        swiglu=args.swiglu, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
    if args.use_rotary_position_embeddings:
        shape = replace(shape, position_embedding_type="rotary")
    try:
        recompute = recompute_settings(args)
    except ArgumentError as error:
        raise CalculatorError(str(error)) from None
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    split_over_tp = tp > 1  # the trainer turns --sequence-parallel and --tp-comm-overlap off at TP 1
    layout = Layout(tensor_parallel=tp, pipeline_parallel=pp,
                    num_gpus=tp * pp if args.num_gpus is None else args.num_gpus,
                    micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                    zero_stage=args.zero_stage, precision=precision,
                    fp32_grad_accumulation=fp32_grad_accumulation(precision, args.grad_accum_dtype),
                    immediate_grad_update=args.immediate_grad_update,
                    checkpoint_activations=recompute["checkpoint_activations"],
                    checkpoint_num_layers=recompute["checkpoint_num_layers"],
                    recompute_method=recompute["recompute_method"], recompute_modules=recompute["recompute_modules"],
                    ulysses=args.ds_sequence_parallel_size, offload_optimizer=args.offload_optimizer,
                    offload_param=args.offload_param, materialized_attention=args.deterministic,
                    sequence_parallel=args.sequence_parallel and split_over_tp,
                    tp_comm_overlap=args.tp_comm_overlap and split_over_tp,
                    pp_partition_method=args.pp_partition_method)
    return shape, layout, TrainingBudget(train_tokens=args.train_tokens, mfu=args.mfu, peak_tflops=args.peak_tflops)


def main(argv: Sequence[str] | None = None) -> dict:
    """Print the report (or its JSON) and return the figures; a bad flag exits with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        figures = calculate(*inputs_from_args(args))
    except CalculatorError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(json.dumps(figures, indent=2) if args.json else format_report(figures))
    return figures


if __name__ == "__main__":
    main()
