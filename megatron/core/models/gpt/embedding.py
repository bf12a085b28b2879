"""Input embedding, the output head tied to it, and the untied output layer."""
import torch
from torch import nn

from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.init import initialize_replicated_weight, stable_embedding_init_method, weight_init_method
from megatron.core.models.gpt.layer_norm import LayerNorm
from megatron.core.models.gpt.positional import LearnedPositionEmbedding
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding, local_linear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)

EMBEDDING_LAYER_NUMBER = 0  # layer number of the embedding in the layout-independent init


def vocab_parallel_logits(hidden_states: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool,
                          tp_group) -> torch.Tensor:
    """This rank's vocabulary slice of x W^T for W [V / tp, h]: [..., h] -> [..., V / tp].
    With sequence parallelism the input is this rank's block [s / tp, ..., h] of a sequence-first
    tensor, all-gathered here: [s / tp, ..., h] -> [s, ..., V / tp]."""
    if sequence_parallel:
        hidden_states = gather_from_sequence_parallel_region(hidden_states, tp_group)  # [s, ..., h]
    else:
        hidden_states = copy_to_tensor_model_parallel_region(hidden_states, tp_group)
    return local_linear(hidden_states.to(weight.dtype), weight)  # a ZeRO-3 weight saved as itself for backward


class Embedding(nn.Module):
    """e = dropout(LN_e(W[tokens]) + P[positions])  -> [b, s, h]

    W: the word embeddings [V, h], split by vocabulary rows over the TP ranks (VocabParallelEmbedding).
    LN_e: only with --embed-layernorm (Megatron-DeepSpeed applies it to the word embeddings alone), on
    the full [b, s, h] lookup that VocabParallelEmbedding has summed over the TP ranks, never on one
    vocabulary partition's share. A stable embedding (config.stable_embedding) has it and draws W
    Xavier-uniform (init.stable_embedding_init_method).
    P: the learned position table, only with --position-embedding-type absolute (rotary and ALiBi act
    inside attention). Dropout is --hidden-dropout, from the default generator (same mask on all TP
    ranks, as e is replicated). The output head reuses W: ``logits(x) = x W^T``.
    """

    def __init__(self, config: GPTModelConfig, groups: ParallelGroups, device=None):
        super().__init__()
        self.config = config
        self.tp_group = groups.tp
        word_init = stable_embedding_init_method if config.stable_embedding else weight_init_method
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, tp_group=groups.tp,
            init_method=word_init(config, EMBEDDING_LAYER_NUMBER, "word_embeddings.weight"),
            use_cpu_initialization=config.use_cpu_initialization, params_dtype=config.params_dtype, device=device)
        self.embed_layernorm = None
        if config.embed_layernorm:
            self.embed_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype, device)
        self.position_embeddings = None
        if config.position_embedding_type == "absolute":
            self.position_embeddings = LearnedPositionEmbedding(
                config.max_position_embeddings, config.hidden_size, config.params_dtype, device)
            initialize_replicated_weight(
                self.position_embeddings.weight,
                weight_init_method(config, EMBEDDING_LAYER_NUMBER, "position_embeddings.weight"),
                config.use_cpu_initialization)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """tokens [b, s], position_ids [b, s] -> [b, s, h] (fp32 with --fp32-residual-connection)."""
        embeddings = self.word_embeddings(tokens)
        if self.embed_layernorm is not None:
            embeddings = self.embed_layernorm(embeddings)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        return self.embedding_dropout(embeddings)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The tied output head: [..., h] -> [..., V / tp] (``vocab_parallel_logits`` on W)."""
        return vocab_parallel_logits(hidden_states, self.word_embeddings.weight, self.config.sequence_parallel,
                                     self.tp_group)


class OutputLayer(VocabParallelEmbedding):
    """The untied output head (--untie-embeddings-and-output-weights): logits = x W_out^T with its own
    W_out [V, h], split by vocabulary rows over the TP ranks like the word embeddings (so it is a
    VocabParallelEmbedding whose forward is the product, not a lookup). Initialised N(0, sigma^2)
    (--init-method-std), as Megatron-LM's output layer; layout-independent under CPU init."""

    def __init__(self, config: GPTModelConfig, groups: ParallelGroups, device=None):
        super().__init__(config.padded_vocab_size, config.hidden_size, tp_group=groups.tp,
                         init_method=weight_init_method(config, config.num_layers + 1, "output_layer.weight"),
                         use_cpu_initialization=config.use_cpu_initialization, params_dtype=config.params_dtype,
                         device=device)
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., V / tp] (sequence parallel: [s / tp, ..., h] -> [s, ..., V / tp])."""
        return vocab_parallel_logits(hidden_states, self.weight, self.sequence_parallel, self.tp_group)
