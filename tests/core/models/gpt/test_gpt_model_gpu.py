"""The GPT model on CUDA, where the fused kernels, flash attention and (with g < n) grouped-query sdpa
run: loss and gradients against the same weights on the CPU references, GPT-2 and Llama-class shapes."""
import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from tests.core.models.gpt.gpt_test_utils import (random_tokens, randomize_parameters, relative_error, tiny_config,
                                                  with_overrides)
from tests.core.models.gpt.test_gpt_model import LLAMA

pytestmark = pytest.mark.gpu

SHAPES = dict(num_layers=2, hidden_size=256, num_attention_heads=8, padded_vocab_size=512, seq_length=128,
              max_position_embeddings=128, kv_channels=32)
VARIANTS = {"gpt": dict(),
            "llama": dict(LLAMA, num_query_groups=2, ffn_hidden_size=512, kv_channels=32),
            "qwen2, rope scaling, partial rotary": dict(LLAMA, num_query_groups=4, ffn_hidden_size=512,
                                                        add_qkv_bias=True, use_rope_scaling=True,
                                                        rope_scaling_original_max_position_embeddings=32,
                                                        rotary_percent=0.5)}


def _loss_and_grads(model, tokens):
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    return loss.detach().float().cpu(), {name: p.grad.float().cpu() for name, p in model.named_parameters()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16: the word embedding's gradient sums the rounded gradients of many positions (3.7 % from fp32
# measured on an H200 for the Llama shapes, 2.x % for GPT's)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-4), (torch.bfloat16, 6e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_model_matches_the_cpu_reference(variant, dtype, tolerance):
    config = tiny_config(**{**SHAPES, **VARIANTS[variant]})
    reference = GPTModel(config, single_rank_groups())
    randomize_parameters(reference, seed=7, scale=0.1)
    tokens = random_tokens(4, 129, 512, seed=8)
    expected_loss, expected_grads = _loss_and_grads(reference, tokens)
    model = GPTModel(with_overrides(config, params_dtype=dtype), single_rank_groups(), device="cuda")
    model.load_state_dict(reference.state_dict())
    loss, grads = _loss_and_grads(model, tokens.cuda())
    assert relative_error(loss, expected_loss) < tolerance / 10
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) < tolerance, name
