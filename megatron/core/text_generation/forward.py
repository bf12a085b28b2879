"""A forward pass of the whole model over the pipeline, for inference.

Every rank of a model replica (its TP x PP ranks) calls with the same tokens. Stage p receives the
hidden states [s, b, h] from stage p - 1 (the first stage embeds the tokens), runs its layers and
sends the result on; the last stage gathers the vocabulary slices of its TP ranks into the full
logits [b, s, V] (fp32). ``logits`` then hands them to every stage; the generation loop instead
shares only the sampled tokens (``share_from_last_stage``): each TP rank of the last stage holds
the same gathered logits and draws the same tokens from the same generator.

With key/value caches (one per layer of the stage, kv_cache.py) a call feeds the positions
``start .. start + s - 1`` only; without, the tokens are the whole sequence from position 0.
"""
import torch

from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.mappings import (broadcast_from_rank, gather_from_tensor_model_parallel_region,
                                                    receive_from_rank, send_to_rank)
from megatron.core.text_generation.kv_cache import LayerKVCache, new_caches
from megatron.core.text_generation.stage_model import InferenceStage


class PipelineForward:
    """The model of one replica split over its TP x PP ranks, called alike on each of them."""

    def __init__(self, stage: InferenceStage, groups: ParallelGroups):
        self.stage = stage.eval()
        self.groups = groups

    @property
    def config(self):
        return self.stage.config

    def new_caches(self, capacity: int) -> list[LayerKVCache]:
        """Empty key/value caches for this stage's layers, ``capacity`` positions each."""
        return new_caches(len(self.stage.layers), capacity)

    @torch.no_grad()
    def last_stage_logits(self, tokens: torch.Tensor, start: int = 0,
                          kv_caches: list[LayerKVCache] | None = None) -> torch.Tensor | None:
        """tokens [b, s] at positions start .. start + s - 1 -> full logits [b, s, V] fp32 on the last
        stage, None on the others."""
        groups = self.groups
        batch, length = tokens.shape
        position_ids = torch.arange(start, start + length, device=tokens.device).expand(batch, length)
        inputs = tokens
        if not groups.is_first_stage:
            inputs = receive_from_rank((length, batch, self.config.hidden_size), self.stage.hidden_dtype,
                                       tokens.device, groups.pp_ranks[groups.pp_rank - 1])
        output = self.stage(inputs, position_ids, kv_caches)
        if not groups.is_last_stage:
            send_to_rank(output, groups.pp_ranks[groups.pp_rank + 1])
            return None
        return gather_from_tensor_model_parallel_region(output, groups.tp).float().contiguous()

    def share_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's ``tensor`` (same shape and dtype on every rank) on every stage, in place."""
        return broadcast_from_rank(tensor, self.groups.pp_ranks[-1], self.groups.pp)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] (the same on every rank) -> logits [b, s, V] fp32 on every rank of the replica."""
        logits = self.last_stage_logits(tokens)
        if logits is None:
            batch, length = tokens.shape
            logits = torch.empty(batch, length, self.config.padded_vocab_size, dtype=torch.float32,
                                 device=tokens.device)
        return self.share_from_last_stage(logits)
