"""Embedding: word (+ LN) + position, dropout, and the tied output head."""
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.embedding import Embedding
from megatron.core.parallel_state import single_rank_groups
from tests.core.models.gpt.gpt_test_utils import random_tokens, randomize_parameters, tiny_config

TOKENS = random_tokens(2, 16, 64, seed=1)
POSITIONS = torch.tensor([list(range(16)), list(range(8)) * 2])


def test_word_plus_position_and_tied_logits():
    embedding = Embedding(tiny_config(), single_rank_groups()).eval()
    word, position = embedding.word_embeddings.weight, embedding.position_embeddings.weight
    torch.testing.assert_close(embedding(TOKENS, POSITIONS), word[TOKENS] + position[POSITIONS])
    hidden = torch.randn(5, 2, 32)
    torch.testing.assert_close(embedding.logits(hidden), hidden @ word.t())


def test_embed_layernorm_applies_to_word_embeddings_only():
    embedding = Embedding(tiny_config(embed_layernorm=True), single_rank_groups()).eval()
    randomize_parameters(embedding, seed=2, scale=0.5)
    norm = embedding.embed_layernorm
    word = F.layer_norm(embedding.word_embeddings.weight[TOKENS], (32,), norm.weight, norm.bias, 1e-5)
    expected = word + embedding.position_embeddings.weight[POSITIONS]
    torch.testing.assert_close(embedding(TOKENS, POSITIONS), expected)


def test_rotary_and_alibi_have_no_position_table():
    for kind in ("rotary", "alibi"):
        embedding = Embedding(tiny_config(position_embedding_type=kind), single_rank_groups()).eval()
        assert embedding.position_embeddings is None
        torch.testing.assert_close(embedding(TOKENS, POSITIONS), embedding.word_embeddings.weight[TOKENS])


def test_embedding_dropout_and_fp32_residual():
    embedding = Embedding(tiny_config(hidden_dropout=0.5), single_rank_groups()).train()
    dropped = embedding(TOKENS, POSITIONS)
    kept = embedding.eval()(TOKENS, POSITIONS)
    zeroed = dropped == 0
    assert 0.3 < float(zeroed.float().mean()) < 0.7
    torch.testing.assert_close(dropped[~zeroed], 2 * kept[~zeroed])
    low = Embedding(tiny_config(params_dtype=torch.bfloat16, fp32_residual_connection=True), single_rank_groups())
    assert low(TOKENS, POSITIONS).dtype == torch.float32
