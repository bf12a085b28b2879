"""GPTModelPipe: the GPT model as a DeepSpeed ``PipelineModule`` list of layers.

Layer list (its indices are Megatron-DeepSpeed's layer numbers, which name the checkpoint files
``layer_XX-model_YY-model_states.pt``; "no state" entries are plain functions):

    0          check_pipeline_inputs          validates the batch tuple (no state)
    1          TiedLayerSpec("embed", EmbeddingPipe)            word (+ position) embeddings
    2          to_sequence_first              [b, s, h] -> [s, b, h] (no state)
    3 .. L+2   ParallelTransformerLayerPipe   transformer layers 1 .. L
    L+3        to_batch_first                 [s, b, h] -> [b, s, h] (no state)
    L+4        LayerNorm or RMSNorm           final norm (build_norm)
    L+5        TiedLayerSpec("embed", EmbeddingPipe, forward_fn=tied_logits)  logits [b, s, V / tp]
               or, untied, OutputLayerPipe (its own weight)
    L+6        logits_for_fp32_loss           (no state) where Megatron-DeepSpeed casts the logits to fp32
    loss_fn    LanguageModelLoss              masked mean cross entropy, in fp32 from logits of any dtype

Batch (from the trainer's batch function): inputs ``(tokens, position_ids)`` or, with
--reset-attention-mask, ``(tokens, position_ids, attention_mask)``; labels ``(labels, loss_mask)``.
With --sequence-parallel layer 2 also keeps this rank's block [s / tp, b, h] of the sequence, layer
L+3 is ``sequence_parallel_hidden`` (the final norm runs on the block) and the head
``tied_logits_batch_first`` gathers the sequence; the layer numbers stay the same.

Between stages flows ``(hidden, position_ids[, attention_mask])``: only ``hidden`` is floating point,
so only it carries a gradient back. The bool mask comes last: NCCL cannot send bool tensors, and
after ``engine.set_has_attention_mask(True)`` DeepSpeed sends the last tensor of the tuple as fp16
and turns it back into bool on the next stage (call it only when the mask is present).

The word embeddings live on the first stage and again, tied, on the last (DeepSpeed all-reduces
their gradients over the two stages). Partition methods are DeepSpeed's: "uniform" (equal layer
counts), "parameters" (balanced parameter counts), "type:<regex>" (balanced count of layers whose
class name matches, e.g. "type:transformer", or "type:transformer|embedding" so the embedding and
the head each weigh as much as a transformer layer). ``stage_boundaries`` computes them upfront.
"""
import re
from functools import partial

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.utils import partition_balanced, partition_uniform

from megatron.core.flops import layer_forward_flops_per_token, output_layer_forward_flops_per_token
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.embedding import Embedding, OutputLayer
from megatron.core.models.gpt.gpt_model import language_model_loss
from megatron.core.models.gpt.layer_norm import norm_class
from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer, limit_selective_recompute
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.mappings import (allreduce_sequence_parallel_gradients,
                                                    scatter_to_sequence_parallel_region,
                                                    sequence_parallel_parameters)
from megatron.core.tensor_parallel.random import checkpoint
from megatron.training.engine.replacements import is_enabled

PARTITION_METHODS = ("uniform", "parameters", "type:<class-name regex>", "flops")


class PipelineInputError(ValueError):
    """The batch handed to the pipeline does not have the layout the first stage expects."""


class EmbeddingPipe(Embedding):
    """Embedding with the pipeline's tuple interface:
    (tokens, position_ids[, mask]) -> (embeddings [b, s, h], position_ids[, mask])."""

    def forward(self, inputs):
        tokens, position_ids, *mask = inputs
        return (super().forward(tokens, position_ids), position_ids, *mask)


def tied_logits(embedding: Embedding, hidden_states: torch.Tensor) -> torch.Tensor:
    """The output head on the tied embedding module: [b, s, h] -> [b, s, V / tp]."""
    return embedding.logits(hidden_states)


def tied_logits_batch_first(embedding: Embedding, hidden_states: torch.Tensor) -> torch.Tensor:
    """The output head under sequence parallelism: [s / tp, b, h] -> [b, s, V / tp]."""
    return embedding.logits(hidden_states).transpose(0, 1)


class OutputLayerPipe(OutputLayer):
    """The untied output head on [b, s, h] -> [b, s, V / tp]; under sequence parallelism on this
    rank's block [s / tp, b, h] -> [b, s, V / tp]."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden_states)
        return logits.transpose(0, 1) if self.sequence_parallel else logits


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """Transformer layer with the pipeline's tuple interface:
    (hidden [s, b, h], position_ids[, mask]) -> (hidden', position_ids[, mask]).

    ``block_recompute`` (a TransformerChunkCheckpoint, set by GPTModelPipe under --recompute-method
    block on the first --recompute-num-layers layers of its stage) checkpoints this layer alone."""

    block_recompute = None

    def forward(self, inputs):
        if self.block_recompute is not None:
            return self.block_recompute(self._layer, *inputs)
        return self._layer(*inputs)

    def _layer(self, hidden_states, position_ids, *mask):
        attention_mask = mask[0] if mask else None
        return (super().forward(hidden_states, position_ids, attention_mask), position_ids, *mask)


def check_pipeline_inputs(inputs):
    """Validate (tokens [b, s] int, position_ids [b, s] int[, attention_mask bool [b, 1, s, s]])."""
    if not isinstance(inputs, (tuple, list)) or len(inputs) not in (2, 3):
        found = f"{type(inputs).__name__} of length {len(inputs)}" if isinstance(inputs, (tuple, list)) \
            else type(inputs).__name__
        raise PipelineInputError("pipeline inputs must be (tokens, position_ids) or (tokens, position_ids, "
                                 f"attention_mask), got {found}")
    tokens, position_ids = inputs[0], inputs[1]
    if tokens.dim() != 2 or tokens.is_floating_point() or position_ids.shape != tokens.shape \
            or position_ids.is_floating_point():
        raise PipelineInputError(f"tokens and position_ids must be integer tensors of one shape [b, s], got "
                                 f"{tokens.dtype} {tuple(tokens.shape)} and {position_ids.dtype} "
                                 f"{tuple(position_ids.shape)}")
    if len(inputs) == 3:
        batch, seq_length = tokens.shape
        mask = inputs[2]
        if mask.dtype != torch.bool or tuple(mask.shape) != (batch, 1, seq_length, seq_length):
            raise PipelineInputError(f"attention_mask must be bool [b, 1, s, s] = {(batch, 1, seq_length, seq_length)}, "
                                     f"got {mask.dtype} {tuple(mask.shape)}")
    return tuple(inputs)


class SwapFirstDims(torch.autograd.Function):
    """[a, b, ...] -> [b, a, ...] contiguous, and the gradient back likewise contiguous.

    ``x.transpose(0, 1).contiguous()`` hands back a transposed (strided) gradient. At the end of the
    layers that strided gradient would flow down the whole residual stream: each layer's
    bias-dropout-add returns it unchanged for the residual, autograd accumulates the norm's gradient
    into it in place, so every layer pays a strided add and a copy in its backward."""

    @staticmethod
    def forward(ctx, x):
        return x.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(0, 1).contiguous()


def to_sequence_first(inputs, sequence_parallel_group=None):
    """(hidden [b, s, h], *rest) -> (hidden [s, b, h], *rest); given the TP group of sequence
    parallelism, this rank's block [s / tp, b, h] of it."""
    hidden = SwapFirstDims.apply(inputs[0])  # [s, b, h]
    hidden = scatter_to_sequence_parallel_region(hidden, sequence_parallel_group)
    return (hidden, *inputs[1:])


def to_batch_first(inputs):
    """(hidden [s, b, h], position_ids[, mask]) -> hidden [b, s, h]; the rest is no longer needed."""
    return SwapFirstDims.apply(inputs[0])


def sequence_parallel_hidden(inputs):
    """(hidden [s / tp, b, h], position_ids[, mask]) -> hidden: with sequence parallelism the final
    norm runs on this rank's block, and the head gathers the sequence (tied_logits_batch_first)."""
    return inputs[0]


def logits_for_fp32_loss(logits: torch.Tensor) -> torch.Tensor:
    """The logits unchanged. Megatron-DeepSpeed's list casts them to fp32 here for the loss; ours
    computes in fp32 from logits of any dtype with the same result (bf16 -> fp32 is exact), without
    the [b, s, V / tp] fp32 copy and its cast back in backward. The entry stays so that the layer
    numbers, and DeepSpeed's "uniform" stage split, stay those of Megatron-DeepSpeed."""
    return logits


class LanguageModelLoss:
    """loss_fn(logits [b, s, V / tp], (labels [b, s], loss_mask [b, s])) -> masked mean cross entropy
    (under DeepSpeed-Ulysses, ``sp_group``, this slice's share: gpt_model.language_model_loss)."""

    def __init__(self, tp_group, sp_group=None):
        self.tp_group, self.sp_group = tp_group, sp_group

    def __call__(self, logits: torch.Tensor, labels_and_mask) -> torch.Tensor:
        labels, loss_mask = labels_and_mask
        return language_model_loss(logits, labels, loss_mask, self.tp_group, self.sp_group)


class TransformerChunkCheckpoint:
    """PipelineModule's activation_checkpoint_func: checkpoint a chunk of transformer layers.

    DeepSpeed calls it as ``f(run_chunk, hidden, position_ids[, mask])`` only for chunks made of
    ParallelTransformerLayerPipe alone (its rule for a module named GPTModelPipe). The layers pass
    position ids and mask through unchanged, so only the hidden states go through the checkpoint.
    """

    def __init__(self, distribute_saved_activations: bool, tp_group):
        self.distribute_saved_activations = distribute_saved_activations
        self.tp_group = tp_group

    def __call__(self, run_chunk, hidden_states, *passthrough):
        def run_hidden(hidden):
            return run_chunk(hidden, *passthrough)[0]

        hidden_states = checkpoint(run_hidden, self.distribute_saved_activations, hidden_states,
                                   tp_group=self.tp_group)
        return (hidden_states, *passthrough)


def gpt_layer_specs(config: GPTModelConfig, groups: ParallelGroups, device=None) -> list:
    """The layer list of the module docstring, for ``PipelineModule(layers=...)``; each layer's
    parameters are created (and initialised) on ``device``, by default the CPU."""
    embedding = dict(tied_weight_attr="word_embeddings.weight", device=device)
    sequence_parallel = config.sequence_parallel
    specs = [check_pipeline_inputs, TiedLayerSpec("embed", EmbeddingPipe, config, groups, **embedding),
             partial(to_sequence_first, sequence_parallel_group=groups.tp) if sequence_parallel else to_sequence_first]
    specs += [LayerSpec(ParallelTransformerLayerPipe, config, number, groups, device=device)
              for number in range(1, config.num_layers + 1)]
    if config.untie_embeddings_and_output_weights:
        head = LayerSpec(OutputLayerPipe, config, groups, device)
    else:
        head = TiedLayerSpec("embed", EmbeddingPipe, config, groups,
                             forward_fn=tied_logits_batch_first if sequence_parallel else tied_logits, **embedding)
    specs += [sequence_parallel_hidden if sequence_parallel else to_batch_first,
              LayerSpec(norm_class(config), config.hidden_size, config.layernorm_epsilon, config.params_dtype,
                        device, sequence_parallel), head, logits_for_fp32_loss]
    return specs


def check_partition_method(partition_method: str) -> None:
    """Raise ValueError unless ``partition_method`` is DeepSpeed's or "flops" (GPTModelPipe's own)."""
    method = partition_method.lower()
    if method not in ("uniform", "parameters", "flops") and not method.startswith("type:"):
        raise ValueError(f"--pp-partition-method {partition_method!r} is not supported; use one of {PARTITION_METHODS}")


def _layer_name(layer) -> str:
    """The name DeepSpeed's "type:" partitioning matches: the class of a spec or module, or a function's name."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, torch.nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", "")


def _parameter_count(layer) -> int:
    if isinstance(layer, LayerSpec):
        layer = layer.build()
    if isinstance(layer, torch.nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _forward_flops_per_token(layer) -> int:
    """A layer's share of the model FLOPs (megatron.core.flops): a transformer layer's, the output
    head's 2hV (the tied embedding with a forward_fn, or the untied output layer), 0 for the rest
    (lookups, norms, transposes)."""
    if isinstance(layer, LayerSpec) and layer.typename is ParallelTransformerLayerPipe:
        config = layer.module_args[0]
        return layer_forward_flops_per_token(config.hidden_size, config.seq_length, config.ffn_hidden_size,
                                             config.projection_size, config.glu_activation is not None,
                                             config.key_value_size)
    if isinstance(layer, TiedLayerSpec) and layer.forward_fn is not None or \
            isinstance(layer, LayerSpec) and layer.typename is OutputLayerPipe:
        config = layer.module_args[0]
        return output_layer_forward_flops_per_token(config.hidden_size, config.padded_vocab_size)
    return 0


def stage_boundaries(layer_specs: list, num_stages: int, partition_method: str) -> list[int]:
    """[0, b_1, ..., len(layer_specs)]: stage i runs layers [b_i, b_{i+1}), as PipelineModule splits them.

    Uses DeepSpeed's own partition_uniform / partition_balanced with the weights its
    ``_partition_layers`` gives each method ("parameters" builds each layer once to count). "flops"
    weighs each layer by its forward FLOPs per token, so the stage with the output head (about 1.8
    layers of a 1.3B GPT with GPT-2's vocabulary) gets fewer transformer layers.
    """
    check_partition_method(partition_method)
    method = partition_method.lower()
    if method == "flops":
        return partition_balanced(weights=[_forward_flops_per_token(layer) for layer in layer_specs],
                                  num_parts=num_stages)
    if method == "uniform":
        return partition_uniform(num_items=len(layer_specs), num_parts=num_stages)
    if method == "parameters":
        return partition_balanced(weights=[_parameter_count(layer) for layer in layer_specs], num_parts=num_stages)
    pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
    weights = [1 if pattern.search(_layer_name(layer)) else 0 for layer in layer_specs]
    if not any(weights):
        raise ValueError(f"--pp-partition-method {partition_method!r} matches no layer; layer classes are "
                         f"{sorted({_layer_name(layer) for layer in layer_specs})}")
    return partition_balanced(weights=weights, num_parts=num_stages)


class GPTModelPipe(PipelineModule):
    """The GPT model as a DeepSpeed PipelineModule; see the module docstring for the layer list.

    ``topology`` is DeepSpeed's PipeModelDataParallelTopology(num_pp, num_mp, num_dp) matching
    ``groups``. ``device`` is where the stage's layers are built: the GPU on a GPU machine, as
    drawing billions of initial values on the CPU takes minutes. Under full recompute with
    --recompute-method uniform (--checkpoint-activations), chunks of --checkpoint-num-layers consecutive
    layers of a stage are recomputed in backward (DeepSpeed checkpoints only chunks made of
    transformer layers; the class name matters: DeepSpeed recognises "GPTModelPipe" for that rule).
    With --recompute-method block the first --recompute-num-layers transformer layers of each stage
    are checkpointed one by one and the rest are not; under selective recompute, block keeps its
    modules to those layers.
    """

    def __init__(self, config: GPTModelConfig, groups: ParallelGroups, topology,
                 partition_method: str = "type:transformer", device=None):
        check_partition_method(partition_method)
        specs = gpt_layer_specs(config, groups, device)
        uniform = config.checkpoint_activations and config.recompute_method == "uniform"
        interval = config.checkpoint_num_layers if uniform else 0
        super().__init__(layers=specs, topology=topology, loss_fn=LanguageModelLoss(groups.tp, groups.sp),
                         partition_method=partition_method, activation_checkpoint_interval=interval,
                         activation_checkpoint_func=TransformerChunkCheckpoint(
                             config.distribute_checkpointed_activations, groups.tp))
        stage_layers = [f for f in self.forward_funcs if isinstance(f, ParallelTransformerLayerPipe)]
        if config.checkpoint_activations and config.recompute_method == "block":
            for layer in stage_layers[:config.checkpoint_num_layers]:
                layer.block_recompute = self.activation_checkpoint_func
        limit_selective_recompute(stage_layers, config)
        self.config = config
        self._sequence_parallel_group = groups.tp
        self._sequence_parallel_hooks = allreduce_sequence_parallel_gradients(self, groups.tp) \
            if config.sequence_parallel else []
        self._reduced_once_per_step: list[torch.nn.Parameter] = []

    def _partition_layers(self, method="uniform"):
        """DeepSpeed's split for its methods; "flops" (``stage_boundaries``) here, listed as DeepSpeed lists."""
        if method.lower() != "flops" or not is_enabled("pipeline_module.GPTModelPipe._partition_layers"):
            return super()._partition_layers(method)
        self.parts = stage_boundaries(self._layer_specs, self.num_stages, method)
        if self.global_rank == 0:
            for stage, (start, stop) in enumerate(zip(self.parts[:-1], self.parts[1:])):
                print(f"stage={stage} layers={stop - start}")
                for index in range(start, stop):
                    print(f"    {index:2d}: {_layer_name(self._layer_specs[index])}")
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])
        return None

    def defer_sequence_parallel_reduction(self) -> None:
        """Sum the sequence-parallel parameters' gradients over the TP group once per step, where the
        engine sums the tied embedding's over its stages, instead of once per parameter and
        micro-batch in backward (6 all-reduces per layer and micro-batch, each a launch on the host).
        The sums are the same (gradients add up linearly over micro-batches). The engine calls this
        when its optimizer keeps gradients until the step: BF16_Optimizer (which reduces its fp32
        accumulators, ``_hp_grad``) or the plain optimizer without ZeRO (``.grad``)."""
        if not is_enabled("pipeline_module.GPTModelPipe.get_tied_weights_and_groups"):
            return
        if self._sequence_parallel_hooks:  # hooked: sequence parallelism over more than one TP rank
            self._reduced_once_per_step = sequence_parallel_parameters(self)
        for handle in self._sequence_parallel_hooks:
            handle.remove()
        self._sequence_parallel_hooks = []

    def get_tied_weights_and_groups(self):
        """DeepSpeed's (weight, group) pairs whose gradients it all-reduces at each step's end; with
        ``defer_sequence_parallel_reduction`` also the sequence-parallel parameters
        of this stage with the TP group."""
        tied = super().get_tied_weights_and_groups()
        if not is_enabled("pipeline_module.GPTModelPipe.get_tied_weights_and_groups"):
            return tied
        return tied + [(param, self._sequence_parallel_group) for param in self._reduced_once_per_step]

    def _synchronize_tied_weights(self):
        """DeepSpeed broadcasts the tied weights in place (at build and after loading a checkpoint);
        without no_grad autograd records that as an op without a derivative on leaf parameters."""
        if not is_enabled("pipeline_module.GPTModelPipe._synchronize_tied_weights"):
            return super()._synchronize_tied_weights()
        with torch.no_grad():
            return super()._synchronize_tied_weights()
