"""Embedding: word (+ LN) + position, dropout, the tied output head, and the stable embedding (TP = 2 = TP = 1)."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.embedding import Embedding
from megatron.core.parallel_state import initialize_model_parallel, single_rank_groups
from tests.core.models.gpt.gpt_test_utils import (copy_full_weights, full_grads, full_weights, random_tokens,
                                                  randomize_parameters, tiny_config)
from tests.dist_utils import run_distributed

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


def test_stable_embedding_draws_xavier_uniform_from_the_full_table():
    """U(-a, a) with a = sqrt(6 / (V + h)) = sqrt(6 / 96) = 0.25 for V = 64, h = 32: bounded, and with the
    uniform's standard deviation a / sqrt(3) (2048 draws: within 5 %)."""
    config = tiny_config(embed_layernorm=True, stable_embedding=True)
    weight = Embedding(config, single_rank_groups()).word_embeddings.weight.detach()
    assert float(weight.abs().max()) <= 0.25
    assert abs(float(weight.std()) - 0.25 / 3 ** 0.5) < 0.05 * 0.25 / 3 ** 0.5


def _stable_embedding_worker(rank, world_size):
    groups = initialize_model_parallel(tensor_model_parallel_size=2)
    config = tiny_config(embed_layernorm=True, stable_embedding=True)
    reference, model = Embedding(config, single_rank_groups()).eval(), Embedding(config, groups).eval()
    gathered = full_weights(model.named_parameters(), groups.tp)
    for name, param in reference.named_parameters():
        assert torch.equal(gathered[name], param.detach()), f"TP=2 init differs: {name}"
    randomize_parameters(reference, seed=5, scale=0.5)
    copy_full_weights(model, {name: param.detach() for name, param in reference.named_parameters()},
                      groups.tp_rank, groups.tp_size)
    upstream = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(6))  # d loss / d output
    outputs = []
    for net in (reference, model):
        output = net(TOKENS, POSITIONS)
        (output * upstream).sum().backward()
        outputs.append(output.detach())
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)
    grads = full_grads(model.named_parameters(), groups.tp)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-6, atol=1e-6, msg=f"gradient of {name}")


@pytest.mark.distributed
def test_stable_embedding_under_tp2_equals_tp1():
    """The LayerNorm normalizes the full lookup (summed over the vocabulary partitions), so TP = 2 gives the
    TP = 1 output and gradients in fp32; a norm per partition would not."""
    run_distributed(_stable_embedding_worker, 2)
