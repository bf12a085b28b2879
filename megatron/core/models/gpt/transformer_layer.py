"""The pre-LN transformer layer, and the layers run on chunks of the micro-batch whose TP all-reduces
overlap the other chunks' compute.

Overlap (--tp-comm-overlap-chunks K). With tensor parallelism each layer all-reduces the outputs of
its two row-parallel GEMMs in forward, and the next operations need the sums: the GPU waits for the
collective. Split the micro-batch into K chunks along b (attention never mixes samples, so every
chunk is an independent forward) and run the layers on all chunks in turn, one step at a time:

    chunk 0: attention -> launch all-reduce A_0 | chunk 1: attention -> launch A_1 |
    chunk 0: wait A_0, MLP -> launch M_0        | chunk 1: wait A_1, MLP -> launch M_1 |
    chunk 0: wait M_0, next layer's attention   | ...

Each collective runs while the other chunks compute; only the last chunk's last one is waited for
at the end of the run of layers. The sum is the same function of the same weights: the loss
matches the unchunked run's to rounding (smaller GEMMs may sum in another order), and with dropout
each chunk draws its own masks.
"""
from collections.abc import Generator, Iterable, Sequence

import torch
from torch import nn

from megatron.core import fused_kernels
from megatron.core.models.gpt.attention import ParallelSelfAttention
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.layer_norm import LayerNorm
from megatron.core.models.gpt.mlp import ParallelMLP
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker


class ParallelTransformerLayer(nn.Module):
    """One pre-LN decoder layer on [s, b, h]:

        a = LN_1(x);  x' = r_1 + dropout(Attn(a))  with r_1 = x (or a with --apply-residual-connection-post-layernorm)
        m = LN_2(x'); y  = r_2 + dropout(MLP(m))   with r_2 = x' (or m)

    Dropout (--hidden-dropout) and the residual add are fused with the projections' biases. With
    --fp32-residual-connection the residual stream x, x', y is fp32 while the LayerNorm outputs
    (the inputs of the matmuls) are in the params dtype. ``layer_number`` is global and 1-based;
    it drives query-key layer scaling and the layout-independent init. With sequence parallelism
    x is this rank's [s / tp, b, h] block; the norms, dropouts and adds run on it, the dropouts
    under the model-parallel RNG stream (each rank holds other positions, so other masks).
    """

    def __init__(self, config: GPTModelConfig, layer_number: int, groups: ParallelGroups, device=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        norm = dict(eps=config.layernorm_epsilon, params_dtype=config.params_dtype, device=device,
                    sequence_parallel=config.sequence_parallel)
        self.input_layernorm = LayerNorm(config.hidden_size, **norm)
        self.self_attention = ParallelSelfAttention(config, layer_number, groups, device=device)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, **norm)
        self.mlp = ParallelMLP(config, layer_number, groups, device=device)
        self.residual_dtype = torch.float32 if config.fp32_residual_connection else config.params_dtype

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor:
        """hidden_states [s, b, h], position_ids [b, s], attention_mask bool [b, 1, s, s] or None -> [s, b, h];
        ``kv_cache``: the layer's key/value cache during inference (ParallelSelfAttention.forward)."""
        normed, output, bias = self._attention_block(hidden_states, position_ids, attention_mask, kv_cache)
        hidden_states = self._residual_add(hidden_states, normed, output, bias)
        normed, output, bias = self._mlp_block(hidden_states)
        return self._residual_add(hidden_states, normed, output, bias)

    def forward_steps(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None) -> Generator[list, None, torch.Tensor]:
        """``forward`` as a generator (without sequence parallelism): it launches each row-parallel
        all-reduce without waiting, yields the launched works before the first line that reads the
        sum, and returns the layer's output. Whoever drives it waits for the works before resuming
        it (``run_layers_overlapped``, after stepping the other chunks)."""
        in_flight: list = []
        normed, output, bias = self._attention_block(hidden_states, position_ids, attention_mask, None, in_flight)
        yield in_flight
        hidden_states = self._residual_add(hidden_states, normed, output, bias)
        in_flight = []
        normed, output, bias = self._mlp_block(hidden_states, in_flight)
        yield in_flight
        return self._residual_add(hidden_states, normed, output, bias)

    def _attention_block(self, hidden_states, position_ids, attention_mask, kv_cache, in_flight=None):
        """(LN_1(x), Attn(LN_1(x)) before its bias, the bias); ``in_flight`` as in ParallelSelfAttention.forward."""
        normed = self.input_layernorm(hidden_states).to(self.config.params_dtype)
        output, bias = self.self_attention(normed, position_ids, attention_mask, kv_cache, in_flight=in_flight)
        return normed, output, bias

    def _mlp_block(self, hidden_states, in_flight=None):
        """(LN_2(x'), MLP(LN_2(x')) before its bias, the bias)."""
        normed = self.post_attention_layernorm(hidden_states).to(self.config.params_dtype)
        output, bias = self.mlp(normed, in_flight=in_flight)
        return normed, output, bias

    def _residual_add(self, hidden_states, normed, output, bias):
        """r + dropout(output + bias), r = the block's input x (or LN(x) with post-LN residuals)."""
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        return self._bias_dropout_add(output, bias, residual)

    def _bias_dropout_add(self, x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x + bias) in the residual dtype."""
        dtype = self.residual_dtype
        add = fused_kernels.bias_dropout_add if self.config.bias_dropout_fusion \
            else fused_kernels.bias_dropout_add_reference
        arguments = (x.to(dtype), bias.to(dtype), residual.to(dtype), self.config.hidden_dropout, self.training)
        if self.config.sequence_parallel and self.training and self.config.hidden_dropout > 0.0:
            with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
                return add(*arguments)
        return add(*arguments)


def _layers_steps(layers: Iterable[ParallelTransformerLayer], hidden_states: torch.Tensor, position_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None) -> Generator[list, None, torch.Tensor]:
    """The steps of the layers one after another on one chunk: [s, b_c, h] -> [s, b_c, h]."""
    for layer in layers:
        hidden_states = yield from layer.forward_steps(hidden_states, position_ids, attention_mask)
    return hidden_states


def interleave_steps(chunk_steps: list[Generator[list, None, torch.Tensor]]) -> list[torch.Tensor]:
    """Step the generators in turn; before a generator resumes, the works it yielded last are waited
    for, so they ran while the other chunks computed. Returns the generators' results in order."""
    waiting: list[Sequence] = [()] * len(chunk_steps)
    results: list[torch.Tensor | None] = [None] * len(chunk_steps)
    running = list(range(len(chunk_steps)))
    while running:
        for index in list(running):
            for work in waiting[index]:
                work.wait()
            try:
                waiting[index] = next(chunk_steps[index])
            except StopIteration as finished:
                results[index] = finished.value
                running.remove(index)
    return results


def run_layers_overlapped(layers: Sequence[ParallelTransformerLayer], hidden_states: torch.Tensor,
                          position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          chunks: int) -> torch.Tensor:
    """The layers one after another on ``hidden_states`` [s, b, h], run as ``chunks`` micro-batch
    chunks [s, b / chunks, h] whose TP all-reduces overlap each other's compute (module docstring).
    position_ids [b, s] and a per-sample attention_mask [b, 1, s, s] are split alike; a mask shared
    by the batch ([1, 1, s, s]) or None serves every chunk. -> [s, b, h]."""
    batch = hidden_states.shape[1]
    if batch % chunks != 0:
        raise ValueError(f"--tp-comm-overlap-chunks {chunks} splits the micro-batch along its samples: the micro-batch "
                         f"({batch} samples) must be divisible by it")
    hidden_chunks = [chunk.contiguous() for chunk in hidden_states.chunk(chunks, dim=1)]  # [s, b / chunks, h]
    position_chunks = position_ids.chunk(chunks, dim=0)
    if attention_mask is not None and attention_mask.shape[0] > 1:
        mask_chunks = attention_mask.chunk(chunks, dim=0)
    else:
        mask_chunks = [attention_mask] * chunks
    outputs = interleave_steps([_layers_steps(layers, hidden, positions, mask)
                                for hidden, positions, mask in zip(hidden_chunks, position_chunks, mask_chunks)])
    return torch.cat(outputs, dim=1)
