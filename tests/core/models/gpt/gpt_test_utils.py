"""Shared helpers of the GPT model tests: tiny configs, deterministic data, gathering TP-split tensors."""
import dataclasses

import torch
import torch.distributed as dist

from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.parallel_state import group_size

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64, seq_length=16,
            max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)


def tiny_config(**overrides) -> GPTModelConfig:
    fields = {**TINY, **overrides}
    if fields.get("position_embedding_type") == "rotary":
        fields["max_position_embeddings"] = None
    return GPTModelConfig(**fields)


def with_overrides(config: GPTModelConfig, **overrides) -> GPTModelConfig:
    return dataclasses.replace(config, **overrides)


def random_tokens(batch: int, seq_length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_length), generator=torch.Generator().manual_seed(seed))


def gather_full(tensor: torch.Tensor, like: torch.Tensor, tp_group) -> torch.Tensor:
    """The full tensor of which ``tensor`` is this rank's TP slice, read from the split attributes
    (tensor_model_parallel, partition_dim, partition_stride) of the parameter ``like``."""
    if not getattr(like, "tensor_model_parallel", False) or group_size(tp_group) == 1:
        return tensor.detach().clone()
    dim, stride = like.partition_dim, like.partition_stride
    slices = [torch.empty_like(tensor) for _ in range(group_size(tp_group))]
    dist.all_gather(slices, tensor.detach().contiguous(), group=tp_group)
    blocks = [torch.chunk(piece, stride, dim=dim) for piece in slices]  # [rank][stride block]
    return torch.cat([blocks[rank][block] for block in range(stride) for rank in range(len(slices))], dim=dim)


def full_weights(named_parameters, tp_group) -> dict[str, torch.Tensor]:
    return {name: gather_full(param, param, tp_group) for name, param in named_parameters}


def full_grads(named_parameters, tp_group) -> dict[str, torch.Tensor]:
    return {name: gather_full(param.grad, param, tp_group) for name, param in named_parameters
            if param.grad is not None}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (normwise)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def randomize_parameters(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    """Give every parameter (biases and norms included) random values, so no term of the math is trivial."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * scale
            base = 1.0 if "layernorm" in name and name.endswith("weight") else 0.0
            param.copy_(noise + base)


def local_slice(full: torch.Tensor, like: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of ``full`` for the parameter ``like`` (inverse of ``gather_full``)."""
    if not getattr(like, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = like.partition_dim, like.partition_stride
    blocks = torch.chunk(full, tp_size * stride, dim=dim)
    return torch.cat(blocks[tp_rank::tp_size], dim=dim)


def copy_full_weights(model: torch.nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int,
                      names=None) -> None:
    """Load full (TP = 1) weights into a TP-split model; ``names`` maps the model's names to ``full``'s."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = full[names(name) if names else name]
            param.copy_(local_slice(source, param, tp_rank, tp_size))
