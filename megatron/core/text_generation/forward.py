"""A forward pass of the whole model over the pipeline, for inference.

Every rank of a model replica (its TP x PP ranks) calls with the same tokens. Stage p receives the
hidden states [s, b, h] from stage p - 1 (the first stage embeds the tokens), runs its layers and
sends the result on; the last stage gathers the vocabulary slices of its TP ranks into the full
logits [b, s, V] (fp32). ``logits`` then hands them to every stage; the generation loop instead
shares only the sampled tokens (``share_from_last_stage``): each TP rank of the last stage holds
the same gathered logits and draws the same tokens from the same generator.

With key/value caches (one per layer of the stage, kv_cache.py) a call feeds the positions
``start .. start + s - 1`` only; without, the tokens are the whole sequence from position 0.
``static_cache`` makes the caches fixed-size (StaticKVCaches, kept from call to call while the
batch and the capacity stay), and ``cuda_graphs`` (one stage, one TP rank, on a GPU) then replays
every one-token step from a CUDA graph captured at the first one (cuda_graph.py) and kept with the
caches. ``compiled_decode`` runs a one-token step after the embedding (the layers, LN_f, the head:
InferenceStage.body) through torch.compile, before the graph captures it: inductor fuses the small
elementwise work around the matmuls (layer norms, bias-GeLU, bias + residual adds, the mask), which
otherwise costs a kernel each: the steps' cost at small batches. It compiles once per batch size
and cache capacity; the prefill stays eager.
"""
import torch

from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.mappings import (broadcast_from_rank, gather_from_tensor_model_parallel_region,
                                                    receive_from_rank, send_to_rank)
from megatron.core.text_generation.cuda_graph import CapturedStep
from megatron.core.text_generation.kv_cache import LayerKVCache, StaticKVCaches, new_caches
from megatron.core.text_generation.stage_model import InferenceStage


class PipelineForward:
    """The model of one replica split over its TP x PP ranks, called alike on each of them."""

    def __init__(self, stage: InferenceStage, groups: ParallelGroups, static_cache: bool = False,
                 cuda_graphs: bool = False, compiled_decode: bool = False):
        if cuda_graphs and not (static_cache and groups.pp_size == 1 and groups.tp_size == 1):
            raise ValueError("CUDA graphs need the static cache, one pipeline stage and one TP rank")
        if compiled_decode and not (static_cache and groups.pp_size == 1 and groups.tp_size == 1):
            raise ValueError("compiled decoding steps need the static cache (fixed shapes), one pipeline stage "
                             "and one TP rank")
        self.stage = stage.eval()
        self.groups = groups
        self.static_cache = static_cache
        self.cuda_graphs = cuda_graphs
        self.decode_body = torch.compile(stage.body, dynamic=False, fullgraph=True) if compiled_decode else None
        self._static_caches: StaticKVCaches | None = None

    @property
    def config(self):
        return self.stage.config

    def new_caches(self, batch: int, capacity: int, device=None) -> list[LayerKVCache]:
        """Key/value caches for this stage's layers, ``capacity`` positions of ``batch`` rows each:
        empty ones, or the static caches (and their captured step) of the last call of that shape."""
        if not self.static_cache:
            return new_caches(len(self.stage.layers), capacity)
        caches = self._static_caches
        if caches is None or (caches.batch, caches.capacity, caches.device) != (batch, capacity, device):
            self._static_caches = None  # the old buffers go before the new ones are made
            caches = self._static_caches = StaticKVCaches(len(self.stage.layers), batch, capacity, device)
        return caches

    @torch.no_grad()
    def last_stage_logits(self, tokens: torch.Tensor, start: int = 0,
                          kv_caches: list[LayerKVCache] | None = None) -> torch.Tensor | None:
        """tokens [b, s] at positions start .. start + s - 1 -> full logits [b, s, V] fp32 on the last
        stage, None on the others."""
        if isinstance(kv_caches, StaticKVCaches):
            kv_caches.position.fill_(start)
            if tokens.shape[1] == 1:
                if not self.cuda_graphs:
                    return self._forward(tokens, kv_caches, start, self.decode_body)
                if kv_caches.decode_graph is None:
                    kv_caches.decode_graph = CapturedStep(
                        lambda step: self._forward(step, kv_caches, body=self.decode_body), tokens)
                return kv_caches.decode_graph(tokens)
        return self._forward(tokens, kv_caches, start)

    def _forward(self, tokens: torch.Tensor, kv_caches, start: int = 0, body=None) -> torch.Tensor | None:
        groups = self.groups
        batch, length = tokens.shape
        offsets = torch.arange(length, device=tokens.device)
        first = start
        if isinstance(kv_caches, StaticKVCaches):
            kv_caches.step.begin(length)
            first = kv_caches.position  # a device tensor
        position_ids = (first + offsets).expand(batch, length)
        inputs = tokens
        if not groups.is_first_stage:
            inputs = receive_from_rank((length, batch, self.config.hidden_size), self.stage.hidden_dtype,
                                       tokens.device, groups.pp_ranks[groups.pp_rank - 1])
        output = self.stage(inputs, position_ids, kv_caches, body)
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
