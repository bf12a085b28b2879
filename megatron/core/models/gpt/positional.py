"""Position information: a learned absolute table, rotary embeddings (GPT-NeoX), ALiBi biases.

Rotary, for the first d channels of a head vector (d = hn x --rotary-percent, even) at position p,
with theta_i = base^(-2i/d), i < d/2:
    x' = x * cos(p theta) + rotate_half(x) * sin(p theta),   rotate_half([x1, x2]) = [-x2, x1]
where the angle vector is [p theta_0 .. p theta_{d/2-1}] repeated twice (GPT-NeoX's and Llama's
layout: channel i pairs with channel i + d/2); the channels past d pass through. The angles, cos,
sin and the rotation are computed in fp32 and the result is cast back, which keeps bf16 and fp16
runs accurate at long positions. Here: the frequencies theta (``rotary_inverse_frequencies``); the
rotation is ``fused_kernels.rotary_embedding`` (a Triton kernel on CUDA).

Llama 3's frequency scaling (``Llama3RopeScaling``) stretches the long wavelengths to a context
``factor`` times the original C: with wavelength w_i = 2 pi / theta_i, low = C / low_freq_factor and
high = C / high_freq_factor,
    theta_i' = theta_i                           if w_i < high
             = theta_i / factor                  if w_i > low
             = (1 - a) theta_i / factor + a theta_i,  a = (C / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor), else.

ALiBi (Press et al.): head j adds m_j * (k - q) to the score of query q and key k, with the slopes
m_j a geometric sequence 2^(-8/n), 2^(-16/n), ...; for n not a power of two the first 2^floor(log2 n)
slopes are followed by every other slope of the 2 * 2^floor(log2 n) sequence. Megatron-DeepSpeed adds
m_j * k instead; the two differ by a constant per query row, which the softmax cancels, and
m_j * (k - q) stays small where it matters (near the diagonal), so it loses less in low precision.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

ROTARY_BASE = 10000.0


class LearnedPositionEmbedding(nn.Module):
    """E[p] for a learned table E: [max_positions, h], replicated on every TP rank."""

    def __init__(self, max_positions: int, hidden_size: int, params_dtype: torch.dtype, device=None):
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(max_positions, hidden_size, dtype=params_dtype, device=device))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """position_ids [b, s] -> [b, s, h]."""
        if position_ids.shape[-1] > self.max_positions:
            raise ValueError(f"sequence of {position_ids.shape[-1]} positions is longer than "
                             f"--max-position-embeddings ({self.max_positions})")
        return nn.functional.embedding(position_ids, self.weight)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3's rope frequency scaling (module docstring), Hugging Face's ``rope_type: llama3``."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """theta [d / 2] -> theta' [d / 2], fp32."""
        context = float(self.original_max_position_embeddings)
        wavelength = 2 * math.pi / inv_freq
        stretched = torch.where(wavelength > context / self.low_freq_factor, inv_freq / self.factor, inv_freq)
        blend = (context / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - blend) * stretched / self.factor + blend * stretched
        medium = (wavelength >= context / self.high_freq_factor) & (wavelength <= context / self.low_freq_factor)
        return torch.where(medium, smoothed, stretched)


def rotary_inverse_frequencies(dim: int, base: float = ROTARY_BASE, scaling: Llama3RopeScaling | None = None,
                               device=None) -> torch.Tensor:
    """theta_i = base^(-2i/dim), i < dim / 2, fp32 [dim / 2], then Llama 3's scaling if given."""
    channel = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32)
    inv_freq = 1.0 / (base ** (channel / dim))
    return inv_freq if scaling is None else scaling.scale(inv_freq)


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi slope of each of the ``num_heads`` heads, fp32 [num_heads]."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one attention head, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += _power_of_two_slopes(2 * closest)[0::2][:num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, seq_length: int, key_length: int | None = None,
               query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """m_j * (k - q) for each head j: fp32 [len(slopes), sq, sk] (add the causal mask separately).

    The queries are the last ``seq_length`` of ``key_length`` positions (default: as many as the
    queries), as when new tokens attend to a key/value cache: query q sits at sk - sq + q; or they
    sit at ``query_positions`` [sq] (a fixed-size cache longer than what it holds).
    """
    key_length = seq_length if key_length is None else key_length
    key_position = torch.arange(key_length, dtype=torch.float32, device=slopes.device)
    if query_positions is None:
        query_positions = key_position[key_length - seq_length:]
    distance = key_position[None, :] - query_positions.to(torch.float32)[:, None]  # [sq, sk]
    return slopes.to(torch.float32)[:, None, None] * distance
