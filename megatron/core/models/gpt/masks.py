"""Loss mask, position ids and attention mask of a left-to-right LM batch, from the tokens alone.

A training sample packs several documents, each ending with the end-of-document token (EOD); the
EOD belongs to the document it closes. Document index of position j = the number of EODs strictly
before j. With Megatron-DeepSpeed's flags:

* --eod-mask-loss: the loss mask is 0 on EOD tokens (1 elsewhere);
* --reset-position-ids: positions restart at 0 after every EOD;
* --reset-attention-mask: a query attends only to keys of its own document (and, as always, not to
  the future): the mask is block-diagonal causal. Without it the mask is None and attention is
  plain causal (the model needs no tensor for that).

Masks are boolean with True = masked out, [b, 1, s, s] (broadcast over heads), as in Megatron-DeepSpeed.
Their causal part is ``fused_kernels.reference.causal_mask``, the one causal mask of the code base.
"""
from typing import NamedTuple

import torch

from megatron.core.fused_kernels.reference import causal_mask


class LtorMasks(NamedTuple):
    attention_mask: torch.Tensor | None  # bool [b, 1, s, s], True = masked; None = plain causal
    loss_mask: torch.Tensor  # float32 [b, s]
    position_ids: torch.Tensor  # int64 [b, s]


def document_ids(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """[b, s] -> [b, s]: the number of EOD tokens strictly before each position."""
    is_eod = (tokens == eod_token).to(torch.int64)
    return torch.cumsum(is_eod, dim=1) - is_eod


def _document_start(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """[b, s] -> [b, s]: index of the first token of each position's document."""
    batch, seq_length = tokens.shape
    index = torch.arange(seq_length, device=tokens.device).expand(batch, seq_length)
    after_eod = torch.where(tokens == eod_token, index + 1, torch.zeros_like(index))  # i + 1 at an EOD i
    # the latest EOD strictly before j: running max over positions < j (shift right by one)
    latest = torch.cummax(after_eod, dim=1).values
    return torch.cat((torch.zeros_like(latest[:, :1]), latest[:, :-1]), dim=1)


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: int, reset_position_ids: bool = False,
                                    reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> LtorMasks:
    """Masks and positions for tokens [b, s]; see the module docstring for each flag."""
    batch, seq_length = tokens.shape
    loss_mask = torch.ones(batch, seq_length, dtype=torch.float32, device=tokens.device)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(seq_length, device=tokens.device).expand(batch, seq_length)
    if reset_position_ids:
        position_ids = position_ids - _document_start(tokens, eod_token)
    attention_mask = None
    if reset_attention_mask:
        document = document_ids(tokens, eod_token)
        other_document = document[:, :, None] != document[:, None, :]  # [b, s (q), s (k)]
        attention_mask = (other_document | causal_mask(seq_length, device=tokens.device)).unsqueeze(1)
    return LtorMasks(attention_mask, loss_mask, position_ids.contiguous())
