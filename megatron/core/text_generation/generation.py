"""Autoregressive generation for a batch of prompts of different lengths, with or without the cache.

The prompts sit left-aligned in one [b, total] token array. Generation steps through positions
t = min prompt length .. total - 1 for all rows at once: the model's next-token choice at t is
written into a row only once its prompt is used up (before that, the row's prompt token stays),
so every row attends to exactly its own prefix and no padding mask is needed. A row stops after
the end-of-document token or its ``max_new_tokens``-th new token; the loop ends when every row
has stopped or at ``max_length`` positions. Whether every row has stopped is read back every
``STOP_CHECK_INTERVAL`` steps only: a read waits for the GPU, which then idles while the host
queues the next step; between reads the host runs ahead. The steps after a stop write nothing.

With the cache (``use_cache``) the first step feeds positions 0 .. t - 1 and each later step one
position; without it (Megatron-DeepSpeed's --recompute), every step feeds the whole prefix 0 .. t - 1,
the reference the cached path must match.

Every rank of the replica runs this loop with the same prompts; the last stage chooses the tokens
and shares them with the other stages, so all ranks hold the same output.
"""
from dataclasses import dataclass

import torch

from megatron.core.text_generation.forward import PipelineForward
from megatron.core.text_generation.sampling import SamplingParams, next_tokens


STOP_CHECK_INTERVAL = 16


class GenerationInputError(ValueError):
    """Prompts the model cannot continue (empty, or as long as the model's context)."""


@dataclass(frozen=True)
class GenerationOutput:
    """tokens [b, total]: prompt then continuation per row (after ``lengths[i]``: filler);
    prompt_lengths, lengths [b]: where each row's continuation starts and ends."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    lengths: torch.Tensor

    def continuation(self, row: int) -> list[int]:
        """The new tokens of ``row`` (the end-of-document token included when it stopped there)."""
        return self.tokens[row, self.prompt_lengths[row]:self.lengths[row]].tolist()

    def sequence(self, row: int) -> list[int]:
        """Prompt and continuation of ``row``."""
        return self.tokens[row, :self.lengths[row]].tolist()


def _prompt_array(prompts: list[list[int]], total: int, filler: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((len(prompts), total), filler, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
    return tokens, torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)


def check_prompts(prompts: list[list[int]], max_length: int) -> None:
    """Every prompt non-empty and shorter than ``max_length`` (room for one new token)."""
    if not prompts:
        raise GenerationInputError("no prompt given")
    for index, prompt in enumerate(prompts):
        if not 0 < len(prompt) < max_length:
            raise GenerationInputError(f"prompt {index} has {len(prompt)} tokens; a prompt needs 1 to "
                                       f"{max_length - 1} tokens (the model's length is {max_length})")


@torch.no_grad()
def generate(model: PipelineForward, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams, *,
             eod: int, vocab_size: int, max_length: int, use_cache: bool = True,
             generator: torch.Generator | None = None, device=None) -> GenerationOutput:
    """Continue each prompt (token ids) by up to ``max_new_tokens`` tokens (module docstring).

    ``vocab_size``: the tokenizer's (padding rows are never chosen); ``max_length``: the positions
    the model takes (--seq-length); ``generator``: the draws' source (seed it for repeatable runs).
    """
    check_prompts(prompts, max_length)
    lengths_list = [len(p) for p in prompts]
    total = min(max(lengths_list) + max_new_tokens, max_length)
    tokens, prompt_lengths = _prompt_array(prompts, total, eod, device)
    limits = torch.clamp(prompt_lengths + max_new_tokens, max=total)  # one past each row's last position
    lengths = limits.clone()
    done = prompt_lengths >= limits
    caches = model.new_caches(len(prompts), total, tokens.device) if use_cache else None
    fed = 0
    first = min(lengths_list)
    for position in range(first, total):
        if (position - first) % STOP_CHECK_INTERVAL == 0 and done.all():
            break
        start = fed if use_cache else 0
        logits = model.last_stage_logits(tokens[:, start:position], start, caches)
        fed = position
        chosen = torch.zeros(len(prompts), dtype=torch.long, device=tokens.device)
        if logits is not None:
            chosen = next_tokens(logits[:, -1], params, vocab_size, generator)
        chosen = model.share_from_last_stage(chosen)
        writes = (position >= prompt_lengths) & ~done
        tokens[:, position] = torch.where(writes, chosen, tokens[:, position])
        stops = writes & ((chosen == eod) | (position + 1 >= limits))
        lengths = torch.where(stops, torch.full_like(lengths, position + 1), lengths)
        done = done | stops
    return GenerationOutput(tokens, prompt_lengths, lengths)
