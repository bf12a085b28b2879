"""Choosing the next token from the logits: greedy, or a draw from the filtered, tempered softmax.

For logits z over the vocabulary (the tokenizer's tokens only: the vocabulary padding rows are
never chosen):

    greedy:       argmax_i z_i
    sampling:     p = softmax(filter(z / T)),  next ~ p
    top-k (k>0):  filter keeps the k largest z / T (ties with the k-th largest kept too), -inf elsewhere
    top-p (p>0):  then keeps the smallest prefix of the tokens sorted by probability whose mass
                  exceeds p (a token goes when the tokens before it already hold more than p)

the order of Megatron-DeepSpeed's ``top_k_logits`` (top-k first, then top-p on what is left). The
draws come from an explicit torch.Generator, so a run under the same --seed repeats.
"""
from dataclasses import dataclass

import torch

GREEDY_SLICES = 128  # greedy_tokens' first pass: a row's maxima over this many slices


class SamplingError(ValueError):
    """Sampling parameters out of range; the message names the flag."""


@dataclass(frozen=True)
class SamplingParams:
    """--greedy, --temperature, --top_k, --top_p (0 = off for both)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0

    def __post_init__(self):
        if not self.temperature > 0.0:
            raise SamplingError(f"--temperature {self.temperature}: must be > 0")
        if self.top_k < 0:
            raise SamplingError(f"--top_k {self.top_k}: must be >= 0 (0 = off)")
        if not 0.0 <= self.top_p <= 1.0:
            raise SamplingError(f"--top_p {self.top_p}: must be in [0, 1] (0 = off)")


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [b, V] fp32 -> (z - max z) / T with the tokens top-k and top-p drop set to -inf (module
    docstring). The shift leaves the softmax as it is and keeps every T > 0 finite: the largest
    entry is 0, so a tiny T sends the others to -inf (the greedy choice) instead of to inf - inf.
    T below the dtype's smallest normal number (it would round to 0, and 0 / 0 is nan) divides as that."""
    temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if params.top_k > 0:
        top_k = min(params.top_k, logits.shape[-1])
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p > 0.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        mass_before = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
        mass_before = torch.cat((torch.zeros_like(mass_before[..., :1]), mass_before[..., :-1]), dim=-1)
        drop_sorted = mass_before > params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a draw follows: softmax of ``filtered_logits``, [b, V]."""
    return torch.softmax(filtered_logits(logits, params), dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of logits [b, V] (the first maximum, as torch.argmax), [b] int64.

    A row of V = 128 k (a column multiple of ``GREEDY_SLICES``) goes in two passes: the maxima of
    its slices, then the first slice holding the largest. torch.argmax spreads a batch-1 row over
    few thread blocks: 27 us for a 128256-token row on an H200, 3 % of a 1.2B model's decoding step.
    Exact: a slice's maximum is the first of that slice, and the first slice holding the row's
    maximum holds its first occurrence."""
    batch, vocab = logits.shape
    if vocab % GREEDY_SLICES or vocab < GREEDY_SLICES * GREEDY_SLICES:
        return torch.argmax(logits, dim=-1)
    maxima, where = logits.reshape(batch, GREEDY_SLICES, -1).max(dim=-1)  # [b, slices]
    slices = torch.argmax(maxima, dim=-1, keepdim=True)
    return (slices * (vocab // GREEDY_SLICES) + where.gather(-1, slices)).squeeze(-1)


def next_tokens(logits: torch.Tensor, params: SamplingParams, vocab_size: int,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [b, V_padded] of the last position -> the next token of each row [b] (int64)."""
    if params.greedy:
        return greedy_tokens(logits[:, :vocab_size])
    logits = logits[:, :vocab_size].float()
    probabilities = sampling_probabilities(logits, params)
    return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(-1)
