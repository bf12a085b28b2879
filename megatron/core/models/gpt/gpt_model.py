"""GPTModel: the whole decoder-only language model on one pipeline stage (PP = 1)."""
import torch
from torch import nn

from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.embedding import Embedding, OutputLayer
from megatron.core.models.gpt.layer_norm import build_norm
from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer, limit_selective_recompute
from megatron.core.parallel_state import ParallelConfigError, ParallelGroups, group_size
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import (allreduce_sequence_parallel_gradients,
                                                    scatter_to_sequence_parallel_region, sum_over_group)
from megatron.core.tensor_parallel.random import checkpoint


def masked_token_mean(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(loss * mask) / sum(mask): the mean loss over the tokens that count (Megatron-DeepSpeed's rule)."""
    loss_mask = loss_mask.to(torch.float32)
    return (losses.float() * loss_mask).sum() / loss_mask.sum()


def sequence_slice_token_mean(losses: torch.Tensor, loss_mask: torch.Tensor, sp_group) -> torch.Tensor:
    """S * sum(loss * mask) / N on each of the S ranks of a DeepSpeed-Ulysses group, each holding one
    slice of the sequences, N the tokens that count in the whole sequences (summed over the group).

    The engine averages losses and gradients over the S ranks as over data-parallel ones, so the
    factor S makes that average the sum of the slices' shares: the whole sequences' masked mean, the
    value and gradient one rank holding them would compute."""
    loss_mask = loss_mask.to(torch.float32)
    tokens = sum_over_group(loss_mask.sum(), sp_group)
    return (losses.float() * loss_mask).sum() * group_size(sp_group) / tokens


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                        tp_group, sp_group=None) -> torch.Tensor:
    """Masked mean cross entropy of vocabulary-parallel logits [..., V / tp] against labels [...];
    with a DeepSpeed-Ulysses group ``sp_group``, this slice's share (``sequence_slice_token_mean``)."""
    losses = vocab_parallel_cross_entropy(logits, labels, tp_group)
    if group_size(sp_group) > 1:
        return sequence_slice_token_mean(losses, loss_mask, sp_group)
    return masked_token_mean(losses, loss_mask)


def default_position_ids(tokens: torch.Tensor) -> torch.Tensor:
    """0, 1, ..., s-1 for every row of tokens [b, s]."""
    batch, seq_length = tokens.shape
    return torch.arange(seq_length, device=tokens.device).expand(batch, seq_length)


class GPTModel(nn.Module):
    """logits = LN_f(Layer_L(... Layer_1(Embedding(tokens)))) W_word^T, on [s, b, h] inside.

    The output head is tied to the word embeddings W_word (one parameter, vocabulary-split over TP),
    or, with --untie-embeddings-and-output-weights, its own ``output_layer``. LN_f is --normalization.
    With labels the model returns the loss: the mean over tokens of the cross entropy, weighted by
    the loss mask (padded vocabulary rows are ordinary classes that targets never hit). Under full
    recompute (--checkpoint-activations, --recompute-granularity full) the layers run in the chunks of
    ``recompute_chunks`` whose activations are recomputed in backward (RNG replayed, so dropout masks
    repeat exactly); selective recompute happens inside each layer. With
    --sequence-parallel the layers and the final norm see this rank's [s / tp, b, h] block (scattered
    after the embedding, gathered again by the output head).

    Dropout needs the model-parallel RNG stream: call
    ``tensor_parallel.random.model_parallel_seed`` before training.
    """

    def __init__(self, config: GPTModelConfig, groups: ParallelGroups, device=None):
        super().__init__()
        if groups.pp_size != 1:
            raise ParallelConfigError(f"GPTModel runs the whole model on one stage; with "
                                      f"--pipeline-model-parallel-size {groups.pp_size} build GPTModelPipe")
        self.config = config
        self.groups = groups
        self.embedding = Embedding(config, groups, device=device)
        self.layers = nn.ModuleList(ParallelTransformerLayer(config, number, groups, device=device)
                                    for number in range(1, config.num_layers + 1))
        limit_selective_recompute(list(self.layers), config)
        self.final_layernorm = build_norm(config, device)
        self.output_layer = OutputLayer(config, groups, device) if config.untie_embeddings_and_output_weights else None
        if config.sequence_parallel:
            allreduce_sequence_parallel_gradients(self, groups.tp)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s]; position_ids [b, s] (default 0..s-1); attention_mask bool [b, 1, s, s]
        (True = masked, see masks.py) or None for causal attention.

        Returns logits [b, s, V / tp] in the params dtype, or, given labels [b, s] (and optionally
        loss_mask [b, s], default all ones), the scalar fp32 loss.
        """
        if position_ids is None:
            position_ids = default_position_ids(tokens)
        hidden_states = self.embedding(tokens, position_ids)  # [b, s, h]
        hidden_states = hidden_states.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.sequence_parallel:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states, self.groups.tp)  # [s / tp, b, h]
        hidden_states = self._run_layers(hidden_states, position_ids, attention_mask)
        hidden_states = self.final_layernorm(hidden_states)
        logits = self.logits(hidden_states)  # [s, b, V / tp]
        if labels is None:
            return logits.transpose(0, 1)  # [b, s, V / tp]
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float32)
        return language_model_loss(logits, labels.t(), loss_mask.t(), self.groups.tp, self.groups.sp)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The output head, tied or untied: [s, b, h] -> [s, b, V / tp]."""
        if self.output_layer is not None:
            return self.output_layer(hidden_states)
        return self.embedding.logits(hidden_states)

    def _run_layers(self, hidden_states, position_ids, attention_mask):
        """The transformer layers, in the chunks of ``recompute_chunks``. [s, b, h]."""

        def run_chunk(start, end):
            def forward_chunk(hidden):
                for layer in self.layers[start:end]:
                    hidden = layer(hidden, position_ids, attention_mask)
                return hidden
            return forward_chunk

        for start, end, recomputed in recompute_chunks(self.config, len(self.layers)):
            if recomputed:
                hidden_states = checkpoint(run_chunk(start, end), self.config.distribute_checkpointed_activations,
                                           hidden_states, tp_group=self.groups.tp)
            else:
                hidden_states = run_chunk(start, end)(hidden_states)
        return hidden_states


def recompute_chunks(config: GPTModelConfig, num_layers: int) -> list[tuple[int, int, bool]]:
    """(start, end, recomputed) runs of a stage's ``num_layers`` layers under full recompute:
    uniform: chunks of N = --recompute-num-layers layers, each checkpointed as a unit; block: the first
    N layers checkpointed one by one, the rest in one plain run. Without full recompute: one plain run."""
    n = config.checkpoint_num_layers
    if not config.checkpoint_activations:
        return [(0, num_layers, False)]
    if config.recompute_method == "uniform":
        return [(start, min(start + n, num_layers), True) for start in range(0, num_layers, n)]
    blocks = [(index, index + 1, True) for index in range(min(n, num_layers))]
    return blocks + ([(n, num_layers, False)] if n < num_layers else [])
