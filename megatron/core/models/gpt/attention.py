"""Causal self-attention with heads split over the tensor-parallel ranks.

Notation: s sequence, b micro-batch, h hidden, n heads, hn head dim, np = n / tp heads on this rank,
g key/value groups (grouped-query attention; g = n is multi-head), ng = g / tp on this rank, and
q = n / g query heads per group.

Two ways to compute the same function, chosen by ``GPTModelConfig.attention_impl``:

* "sdpa" (default): ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal`` for
  the plain causal case and an additive bias (ALiBi, and -inf where --reset-attention-mask or the
  causal mask forbids) otherwise. Its kernels accumulate q.k in fp32, so query-key layer scaling
  (which only protects fp16 score matmuls from overflow) has nothing to do; mathematically
  softmax(q k^T / sqrt(hn) + B) is what both paths compute.
* "materialized": Megatron-DeepSpeed's order of operations. scores = q k^T / norm_factor with
  norm_factor = sqrt(hn) * layer_number under query-key layer scaling (sqrt(hn) otherwise), in the
  params dtype; probs = scale_mask_softmax(scores, scale=layer_number) in fp32; dropout; probs v.
  ALiBi enters the scores as B / layer_number so the softmax sees q k^T / sqrt(hn) + B again.

DeepSpeed-Ulysses (``groups.sp``, --ds-sequence-parallel-size S): the layer sees this rank's slice of
s / S positions. The projection's output [s / S, b, g (q + 2) hn] is all-to-all'ed, a chunk of
key/value groups at a time, to the whole sequence of 1 / S of each chunk's groups; the heads are split
and rotated there (at the whole sequence's positions, gathered once per layer), either path above
attends over the full length, and the outputs go back to this rank's positions, the exchanges of one
chunk overlapping the attention of another (``ulysses.pipelined_attention``).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import fused_kernels
from megatron.core.models.gpt import ulysses
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.init import weight_init_method
from megatron.core.models.gpt.positional import (Llama3RopeScaling, alibi_bias, alibi_slopes,
                                                 rotary_inverse_frequencies)
from megatron.core.models.gpt.ulysses_projections import HeadLayout, overlapped_attention
from megatron.core.parallel_state import ParallelGroups, group_size
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG, CheckpointWithoutOutput, get_rng_tracker
from megatron.core.tensor_parallel.utils import all_gather_along_first_dim, divide


class ParallelSelfAttention(nn.Module):
    """o = concat_j(dropout(softmax(q_j k_{j//q}^T / sqrt(hn) + B_j + causal)) v_{j//q}) W_o^T + b_o.

    ``query_key_value`` is a ColumnParallelLinear h -> (n + 2g) hn whose output rows are ordered per
    key/value group, [g, q + 2, hn] (the group's q query heads, its key, its value; with g = n the
    per-head [n, 3, hn] of Megatron-DeepSpeed), so splitting the rows over TP ranks hands each rank
    ng whole groups and their query heads. ``dense`` is a RowParallelLinear n hn -> h whose
    all-reduce sums the heads of all ranks; its bias is returned unadded (skip_bias_add) for the fused
    bias-dropout-add. Without biases (--disable-bias-linear) both return None for it; --add-qkv-bias
    keeps the projection's.
    Attention dropout runs under the model-parallel RNG fork: different heads live on different
    ranks and need independent masks.
    """

    def __init__(self, config: GPTModelConfig, layer_number: int, groups: ParallelGroups, device=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.recompute_modules = config.recompute_modules  # selective recompute's (limit_selective_recompute)
        self.heads_per_partition = divide(config.num_attention_heads, groups.tp_size)
        self.groups_per_partition = divide(config.num_query_groups, groups.tp_size)
        self.head_dim = config.kv_channels
        self.sequence_parallel_group, self.sequence_parallel_rank = groups.sp, groups.sp_rank
        self.tensor_parallel_size = groups.tp_size
        common = dict(tp_group=groups.tp, use_cpu_initialization=config.use_cpu_initialization,
                      params_dtype=config.params_dtype, device=device,
                      sequence_parallel=config.sequence_parallel,
                      comm_overlap=config.tp_comm_overlap, fp8=config.fp8_for_layer(layer_number))
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, config.query_key_value_size, gather_output=False, bias=config.qkv_bias,
            init_method=weight_init_method(config, layer_number, "self_attention.query_key_value.weight"), **common)
        self.dense = RowParallelLinear(
            config.projection_size, config.hidden_size, input_is_parallel=True, skip_bias_add=True,
            bias=config.add_bias_linear,
            init_method=weight_init_method(config, layer_number, "self_attention.dense.weight",
                                           output_projection=True), **common)
        if config.position_embedding_type == "rotary":
            scaling = None
            if config.use_rope_scaling:
                scaling = Llama3RopeScaling(config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                                            config.rope_scaling_high_freq_factor,
                                            config.rope_scaling_original_max_position_embeddings)
            # fp32 whatever the params dtype: a plain attribute, out of reach of module.to(dtype) and
            # of DeepSpeed's casts of the module to bf16 / fp16 (rotary_frequencies moves it)
            self._rotary_inv_freq = rotary_inverse_frequencies(config.rotary_dim, config.rotary_base, scaling)
        if config.position_embedding_type == "alibi":
            first_head = groups.tp_rank * self.heads_per_partition
            slopes = alibi_slopes(config.num_attention_heads)[first_head:first_head + self.heads_per_partition]
            self.register_buffer("alibi_slopes", slopes.to(device), persistent=False)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [s, b, h], position_ids [b, s], attention_mask bool [b, 1, s, s] (True = masked,
        causality included) or None for plain causal attention -> (output [s, b, h], bias [h])."""
        if self._overlaps_projections():
            return self.projections_overlapped_ulysses(hidden_states, position_ids, attention_mask), self.dense.bias
        # [s, b, np * 3 * hn], whole s under sequence parallelism; the bias gradient is summed by the split
        mixed, _ = self.query_key_value(hidden_states, bias_grad_by_caller=True)
        if "core_attn" in self.recompute_modules:
            return self._dense_of_recomputed_core(mixed, position_ids, attention_mask)
        return self.dense(self.attend(mixed, position_ids, attention_mask, self.query_key_value.bias))

    def _overlaps_projections(self) -> bool:
        """DeepSpeed-Ulysses with the exchanges beside the projections (``ulysses.OVERLAP_PROJECTIONS``), where
        the plain projections run: TP = 1, no FP8, the attention core not recomputed alone."""
        return (self.sequence_parallel_group is not None and ulysses.OVERLAP_PROJECTIONS
                and self.tensor_parallel_size == 1 and self.query_key_value.fp8_gemms is None
                and "core_attn" not in self.recompute_modules)

    def projections_overlapped_ulysses(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                                       attention_mask: torch.Tensor | None) -> torch.Tensor:
        """DeepSpeed-Ulysses with one attention call for this rank's heads and the exchanges beside the
        projections (``ulysses_projections``): hidden_states [s / S, b, h] -> dense's output [s / S, b, h]
        without its bias."""
        group = self.sequence_parallel_group
        position_ids = self._whole_sequence_positions(position_ids)
        share = divide(self.groups_per_partition, group_size(group))
        first_head = self.sequence_parallel_rank * share * self.config.queries_per_group

        def attend(query, key, value):
            return merge_heads(self.attend_heads(*self.positioned(query, key, value, position_ids), attention_mask,
                                                 first_head=first_head))

        layout = HeadLayout(self.groups_per_partition, self.config.queries_per_group, self.head_dim)
        return overlapped_attention(hidden_states, self.query_key_value.weight, self.query_key_value.bias,
                                    self.dense.weight, attend, layout, group)

    def _whole_sequence_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Under Ulysses with rotary embeddings: the whole sequence's position ids [b, s], in rank order (the
        rotation is applied after the exchange); otherwise ``position_ids`` as they are."""
        if self.config.position_embedding_type != "rotary":
            return position_ids
        return all_gather_along_first_dim(position_ids.t().contiguous(), self.sequence_parallel_group).t().contiguous()

    def _dense_of_recomputed_core(self, mixed: torch.Tensor, position_ids: torch.Tensor,
                                  attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Selective recompute of the core: ``attend`` keeps nothing but the projection's output
        ``mixed``, and dense no copy of its result: dense's backward recomputes it, dropout replayed."""
        recompute = CheckpointWithoutOutput()
        context = recompute.checkpoint(self.attend, mixed, position_ids, attention_mask, self.query_key_value.bias)
        with recompute.consumers():
            return self.dense(context)

    def attend(self, mixed: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               mixed_bias: torch.Tensor | None = None) -> torch.Tensor:
        """What runs between the two projections (arguments as ``forward``'s): query_key_value's
        output [s, b, np * 3 * hn] -> the heads' outputs [s, b, np * hn], dense's input. ``mixed_bias``:
        the projection's bias when it is in ``mixed`` without its gradient (``split_query_key_value``)."""
        if self.sequence_parallel_group is not None:
            return self.ulysses_attention(mixed, position_ids, attention_mask, mixed_bias)
        return merge_heads(self.attend_heads(*self.heads(mixed, position_ids, mixed_bias), attention_mask))

    def attend_heads(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, first_head: int = 0) -> torch.Tensor:
        """query [b, heads, s, hn], key, value [b, groups, s, hn] -> [b, heads, s, hn], the heads being
        this TP rank's from ``first_head`` on (their ALiBi slopes)."""
        heads, seq_length = query.shape[1], query.shape[2]
        alibi = None
        if self.config.position_embedding_type == "alibi":
            slopes = self.alibi_slopes[first_head:first_head + heads]
            alibi = alibi_bias(slopes, seq_length, seq_length).to(query.dtype)
        if self.config.attention_impl == "sdpa":
            return self.sdpa(query, key, value, alibi, attention_mask)
        return self._materialized(query, key, value, alibi, attention_mask)

    def ulysses_attention(self, mixed: torch.Tensor, position_ids: torch.Tensor,
                          attention_mask: torch.Tensor | None, mixed_bias: torch.Tensor | None) -> torch.Tensor:
        """DeepSpeed-Ulysses (module docstring, ``ulysses``): the projection's output [s / S, b, ng (q + 2) hn]
        of this rank's positions, position_ids [b, s / S] (global values), ``attention_mask`` the whole
        sequence's [b, 1, s, s] or None -> dense's input [s / S, b, np hn]."""
        group = self.sequence_parallel_group
        size = group_size(group)
        position_ids = self._whole_sequence_positions(position_ids)
        queries_per_group = self.config.queries_per_group
        chunks = ulysses.chunk_count(self.groups_per_partition, size, queries_per_group)
        share = self.groups_per_partition // (chunks * size)  # key/value groups per rank and chunk

        def attend_share(recv, chunk):
            first_group = chunk * share * size + self.sequence_parallel_rank * share
            context = self.attend_heads(*self.heads(recv, position_ids), attention_mask,
                                        first_head=first_group * queries_per_group)
            return merge_heads(context)

        return ulysses.pipelined_attention(mixed, mixed_bias, attend_share, group, chunks)

    def heads(self, mixed: torch.Tensor, position_ids: torch.Tensor,
              mixed_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query_key_value's output [s, b, ng * (q + 2) * hn] -> query [b, np, s, hn], key, value
        [b, ng, s, hn], the rotary embedding applied to query and key."""
        # q [s, b, np, hn], k and v [s, b, ng, hn]
        query, key, value = fused_kernels.split_query_key_value(mixed, mixed_bias, self.head_dim,
                                                                self.config.queries_per_group)
        return self.positioned(query, key, value, position_ids)

    def positioned(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query [s, b, np, hn], key, value [s, b, ng, hn] -> query [b, np, s, hn], key, value [b, ng, s, hn],
        the rotary embedding applied to query and key."""
        if self.config.position_embedding_type == "rotary":  # and [s, b, heads, hn] -> [b, heads, s, hn]
            query, key = fused_kernels.rotary_embedding(query, key, position_ids,
                                                        self.rotary_frequencies(position_ids.device))
        else:
            query, key = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)
        return query, key, value.permute(1, 2, 0, 3)

    def rotary_frequencies(self, device: torch.device) -> torch.Tensor:
        """The rotary inverse frequencies [d / 2], fp32, on ``device`` (moved there once)."""
        if self._rotary_inv_freq.device != device:
            self._rotary_inv_freq = self._rotary_inv_freq.to(device)
        return self._rotary_inv_freq

    def _dropout_probability(self) -> float:
        return self.config.attention_dropout if self.training else 0.0

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, alibi: torch.Tensor | None,
             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """scaled_dot_product_attention of query [b, np, s, hn] over key, value [b, ng, T, hn] -> [b, np, s, hn]
        (query head j reads key/value group j // q):
        with is_causal, or with the additive bias B + mask (True = hidden; without one the queries are
        the last s of the T positions, as in a decoding step over a cache)."""
        bias = None
        seq_length, key_length = query.shape[-2], key.shape[-2]
        if alibi is not None or attention_mask is not None or seq_length != key_length:
            if attention_mask is None:
                attention_mask = fused_kernels.causal_mask(seq_length, key_length, device=query.device)
            if alibi is None:
                bias = ~attention_mask  # bool: True = may attend
            else:
                bias = alibi.masked_fill(attention_mask, float("-inf"))  # [b or 1, np, s, s]
        dropout = self._dropout_probability()
        options = dict(attn_mask=bias, is_causal=bias is None, scale=1.0 / math.sqrt(self.head_dim))
        if key.shape[1] != query.shape[1]:
            if query.is_cuda:
                # torch's fused grouped-query attention (enable_gqa) runs only in the flash kernel; the
                # cuDNN kernel, about twice as fast on Hopper, takes keys and values repeated per head
                key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
            else:
                options["enable_gqa"] = True
        if dropout == 0.0:
            return F.scaled_dot_product_attention(query, key, value, **options)
        with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, **options)

    def _materialized(self, query, key, value, alibi, attention_mask):
        """Megatron-DeepSpeed's path: scores in the params dtype, scale-mask-softmax (fp32), dropout, probs v.
        Grouped keys and values [b, ng, s, hn] are repeated to the np query heads first."""
        batch, heads, seq_length, head_dim = query.shape
        if key.shape[1] != heads:
            key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
        coefficient = float(self.layer_number) if self.config.apply_query_key_layer_scaling else 1.0
        norm_factor = math.sqrt(head_dim) * coefficient
        # the 1 / norm_factor scaling happens inside the GEMM (fp32 accumulator), so fp16 scores never
        # hold the unscaled q.k: that is what query-key layer scaling is for
        if alibi is None:
            scores = torch.empty(batch * heads, seq_length, seq_length, dtype=query.dtype, device=query.device)
            beta = 0.0
        else:
            scores = alibi.expand(batch, heads, seq_length, seq_length).reshape(batch * heads, seq_length, seq_length)
            beta = 1.0 / coefficient
        scores = torch.baddbmm(scores, query.reshape(batch * heads, seq_length, head_dim),
                               key.reshape(batch * heads, seq_length, head_dim).transpose(1, 2),
                               beta=beta, alpha=1.0 / norm_factor)
        scores = scores.view(batch, heads, seq_length, seq_length)
        softmax = fused_kernels.scale_mask_softmax if self.config.masked_softmax_fusion \
            else fused_kernels.scale_mask_softmax_reference
        probs = softmax(scores, attention_mask, coefficient, attention_mask is None, self.config.softmax_in_fp32)
        dropout = self._dropout_probability()
        if dropout > 0.0:
            with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
                probs = F.dropout(probs, p=dropout, training=True)
        return torch.matmul(probs, value)  # [b, np, s, hn]


def merge_heads(context: torch.Tensor) -> torch.Tensor:
    """The heads' outputs [b, np, s, hn] -> [s, b, np * hn], dense's input."""
    batch, _, seq_length, _ = context.shape
    return context.permute(2, 0, 1, 3).reshape(seq_length, batch, -1)
