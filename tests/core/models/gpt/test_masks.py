"""Loss mask, position ids and attention mask against hand-written expectations."""
import torch

from megatron.core.models.gpt.masks import causal_mask, document_ids, get_ltor_masks_and_position_ids

EOD = 0
# two rows: documents end at the EODs (0); the EOD belongs to the document it closes
TOKENS = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4],
                       [0, 3, 3, 3, 3, 0, 0, 2]])


def test_defaults_are_plain_causal():
    masks = get_ltor_masks_and_position_ids(TOKENS, EOD)
    assert masks.attention_mask is None
    torch.testing.assert_close(masks.loss_mask, torch.ones(2, 8))
    torch.testing.assert_close(masks.position_ids, torch.arange(8).expand(2, 8))


def test_eod_mask_loss():
    masks = get_ltor_masks_and_position_ids(TOKENS, EOD, eod_mask_loss=True)
    expected = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1],
                             [0, 1, 1, 1, 1, 0, 0, 1]], dtype=torch.float32)
    torch.testing.assert_close(masks.loss_mask, expected)


def test_reset_position_ids():
    masks = get_ltor_masks_and_position_ids(TOKENS, EOD, reset_position_ids=True)
    expected = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0],
                             [0, 0, 1, 2, 3, 4, 0, 0]])
    torch.testing.assert_close(masks.position_ids, expected)
    assert masks.attention_mask is None


def test_document_ids():
    expected = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2],
                             [0, 1, 1, 1, 1, 1, 2, 3]])
    torch.testing.assert_close(document_ids(TOKENS, EOD), expected)


def test_reset_attention_mask_is_block_diagonal_causal():
    mask = get_ltor_masks_and_position_ids(TOKENS, EOD, reset_attention_mask=True).attention_mask
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    allowed_row0 = torch.zeros(8, 8, dtype=torch.bool)
    for block in ((0, 3), (3, 7), (7, 8)):  # documents [5 6 0] [7 8 9 0] [4]
        for q in range(*block):
            for k in range(block[0], q + 1):
                allowed_row0[q, k] = True
    torch.testing.assert_close(mask[0, 0], ~allowed_row0)
    allowed_row1 = torch.zeros(8, 8, dtype=torch.bool)
    for block in ((0, 1), (1, 6), (6, 7), (7, 8)):  # [0] [3 3 3 3 0] [0] [2]
        for q in range(*block):
            for k in range(block[0], q + 1):
                allowed_row1[q, k] = True
    torch.testing.assert_close(mask[1, 0], ~allowed_row1)


def test_without_eod_reset_mask_is_causal():
    tokens = torch.tensor([[1, 2, 3, 4]])
    mask = get_ltor_masks_and_position_ids(tokens, EOD, reset_attention_mask=True).attention_mask
    torch.testing.assert_close(mask[0, 0], causal_mask(4))
    torch.testing.assert_close(causal_mask(3), torch.tensor([[False, True, True],
                                                             [False, False, True],
                                                             [False, False, False]]))
