"""Layer steps over the key/value cache (decode_layers.py) against the training model.

* For every position option we train (learned, rotary, ALiBi) with a GLU, an embedding LayerNorm and
  fp32 residuals: the logits of a cached run (either cache), fed in chunks, equal GPTModel's logits
  of the whole sequence; the batched greedy output equals GPTModel's step-by-step argmax of each prompt alone.
* One-token steps of one sequence over the static cache take the fused five-op path.
"""
import pytest
import torch

from megatron.core import fused_kernels
from megatron.core.text_generation.decode_layers import layer_step
from megatron.core.text_generation.kv_cache import LayerKVCache
from tests.core.text_generation.generation_test_utils import (EOD, NEW_TOKENS, OPTIONS, PROMPTS, VOCAB,
                                                              cached_logits_in_chunks, inference_of, run, tiny_model)


@pytest.mark.parametrize("static_cache", [False, True], ids=["growing cache", "static cache"])
@pytest.mark.parametrize("name", OPTIONS)
def test_cached_logits_equal_the_training_model(name, static_cache):
    model = tiny_model(seed=3, **OPTIONS[name])
    inference = inference_of(model, static_cache)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens).float()
    torch.testing.assert_close(cached_logits_in_chunks(inference, tokens), expected, rtol=1e-5, atol=5e-5)  # fp32 rounding

    found = run(inference)
    for row, prompt in enumerate(PROMPTS):
        sequence = list(prompt)
        while len(sequence) < len(prompt) + NEW_TOKENS and (len(sequence) == len(prompt) or sequence[-1] != EOD):
            with torch.no_grad():
                sequence.append(int(model(torch.tensor([sequence]))[0, -1, :VOCAB].argmax()))
        assert found.sequence(row) == sequence


ONE_ROW_OPTIONS = {"learned, tanh GeLU": dict(), "rotary, erf GeLU": dict(position_embedding_type="rotary",
                                                                        bias_gelu_fusion=False),
                   "alibi, embedding LN": dict(position_embedding_type="alibi", embed_layernorm=True),
                   "llama": OPTIONS["llama: RMSNorm, GQA, swiglu, untied, no bias"]}


@pytest.mark.parametrize("name", ONE_ROW_OPTIONS)
def test_one_row_steps_take_the_fused_layer_path_and_equal_the_training_model(name, monkeypatch):
    """One-token steps of one sequence over the static cache run each layer as layer_norm_linear,
    attention, linear + residual, layer_norm_linear + activation, linear + residual (the kernels of
    a GPU); their logits are the training model's, and batch 1 generates what batch 5 does."""
    fused_calls = []
    fused = fused_kernels.layer_norm_linear
    monkeypatch.setattr(fused_kernels, "layer_norm_linear",
                        lambda *args: fused_calls.append(args[6] or "qkv") or fused(*args))
    model = tiny_model(seed=8, **ONE_ROW_OPTIONS[name])
    inference = inference_of(model, static_cache=True)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens).float()
    torch.testing.assert_close(cached_logits_in_chunks(inference, tokens), expected, rtol=1e-5, atol=5e-5)
    activation = {"rotary, erf GeLU": "gelu", "llama": "swiglu"}.get(name, "gelu_tanh")
    assert fused_calls == ["qkv", activation] * (4 * 3)  # 4 one-token steps of 3 layers
    fused_calls.clear()
    batched = run(inference)
    assert fused_calls == []  # five rows: forward's path
    for row, prompt in enumerate(PROMPTS):
        assert run(inference, prompts=[prompt]).continuation(0) == batched.continuation(row)
    assert fused_calls


def test_grouped_query_caches_hold_the_key_value_groups():
    """With g key/value groups a layer's cache is [b, g, capacity, hn]: memory ∝ g, not n."""
    model = tiny_model(seed=5, **OPTIONS["llama: RMSNorm, GQA, swiglu, untied, no bias"])
    layer, cache = model.layers[0], LayerKVCache(16)
    hidden = torch.randn(6, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    positions = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        expected = layer(hidden, positions)
        got = layer_step(layer, hidden, positions, cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert tuple(cache.keys.shape) == tuple(cache.values.shape) == (2, 2, 16, model.config.kv_channels)
