"""Generation with and without the key/value cache, against transformers' ``generate`` and the
training model.

* Greedy, 32 new tokens for 5 prompts of different lengths in one batch: token for token what
  transformers' GPT2LMHeadModel (learned positions) and BloomForCausalLM (ALiBi, embedding LayerNorm)
  generate from the same weights, one prompt at a time; with the growing cache, the static one (the
  CUDA-graph path's) and without a cache (--recompute).
* Compiled one-token steps equal the training model; the static caches serve the next call.
* Sampling under a seed repeats, and the cache does not change which tokens a seed draws.
"""
import dataclasses

import pytest
import torch

from megatron.core.checkpoint.names import pipeline_name
from megatron.core.checkpoint.transformers_export import exported_layer, transformers_config
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.text_generation.generation import GenerationInputError
from megatron.core.text_generation.sampling import SamplingParams
from tests.core.text_generation.generation_test_utils import (EOD, MAX_LENGTH, NEW_TOKENS, OPTIONS, PROMPTS, VOCAB,
                                                              cached_logits_in_chunks, inference_of, run, tiny_model)

transformers = pytest.importorskip("transformers")


def transformers_model(model: GPTModel, vocab_size: int = VOCAB, eod: int = EOD):
    """transformers' model of our weights (the exporter's per-layer mapping), the vocabulary cut to
    ``vocab_size`` (the padding rows dropped); ``eod`` ends a generation."""
    config = dataclasses.asdict(model.config)
    layers = {}
    for name, tensor in model.state_dict().items():
        layer, _, rest = pipeline_name(name, config["num_layers"]).partition(".")
        index, local = (1, name.removeprefix("embedding.")) if layer == "tied_modules" else (int(layer), rest)
        layers.setdefault(index, {})[local] = tensor
    state = {}
    for layer, layer_state in layers.items():
        state.update(exported_layer(config, layer, layer_state, vocab_size))
    hf_config = transformers_config(config, vocab_size, torch.float32)
    kind = hf_config.pop("architectures")[0]
    hf_class = getattr(transformers, kind)
    hf_model = hf_class(hf_class.config_class(**hf_config, bos_token_id=eod, eos_token_id=eod)).eval()
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    assert not unexpected and all("attn.bias" in name or "lm_head" in name for name in missing), missing
    return hf_model


@pytest.mark.parametrize("options", [dict(), dict(position_embedding_type="alibi", embed_layernorm=True)],
                         ids=["GPT2LMHeadModel", "BloomForCausalLM"])
def test_greedy_equals_transformers_generate(options):
    model = tiny_model(**options)
    hf_model = transformers_model(model)
    expected = []
    for prompt in PROMPTS:
        output = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   eos_token_id=EOD, pad_token_id=EOD, attention_mask=torch.ones(1, len(prompt)))
        expected.append(output[0, len(prompt):].tolist())
    for static_cache, use_cache in ((False, True), (True, True), (False, False)):
        found = run(inference_of(model, static_cache), use_cache=use_cache)
        assert [found.continuation(row) for row in range(len(PROMPTS))] == expected
    assert sum(len(tokens) for tokens in expected) > 4 * NEW_TOKENS  # not all stopped at once


@pytest.mark.slow
def test_compiled_decoding_steps_and_reused_static_caches():
    """One-token steps through torch.compile (inductor on CPU: the GPU path's graph, other kernels)
    give the training model's logits; the static caches serve the next call of the same shape, and
    generation over them, compiled, equals the growing cache's."""
    model = tiny_model(seed=6, **OPTIONS["alibi + embedding LN + fp32 residual"])
    compiled = inference_of(model, static_cache=True, compiled_decode=True)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).float()
    torch.testing.assert_close(cached_logits_in_chunks(compiled, tokens), expected, rtol=1e-5, atol=5e-5)

    with pytest.raises(ValueError, match="compiled decoding steps need the static cache"):
        inference_of(model, static_cache=False, compiled_decode=True)
    caches = compiled.new_caches(5, 64)
    assert compiled.new_caches(5, 64) is caches and compiled.new_caches(4, 64) is not caches
    other_prompts = [prompt[::-1] for prompt in PROMPTS]
    for prompts in (PROMPTS, other_prompts, PROMPTS):
        assert torch.equal(run(compiled, prompts=prompts).tokens, run(inference_of(model), prompts=prompts).tokens)


def test_sampling_repeats_under_a_seed_with_or_without_the_cache():
    inference = inference_of(tiny_model(seed=4))
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
    draws = [run(inference, params, use_cache, torch.Generator().manual_seed(seed)).tokens
             for seed, use_cache in ((7, True), (7, True), (7, False), (8, True))]
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])
    assert not torch.equal(draws[0], draws[3])
    assert int(draws[0].max()) < VOCAB  # the vocabulary padding is never drawn


def test_lengths_stop_and_bad_prompts():
    inference = inference_of(tiny_model(seed=5))
    long_prompt = list(range(1, MAX_LENGTH - 3))
    found = run(inference, prompts=[long_prompt, [4, 5]])
    for row, limit in ((0, MAX_LENGTH), (1, 2 + NEW_TOKENS)):  # the model's length, --out-seq-length
        continuation = found.continuation(row)
        assert found.lengths[row] == limit or continuation[-1] == EOD
        assert EOD not in continuation[:-1]
    with pytest.raises(GenerationInputError, match="prompt 1 has 64 tokens; a prompt needs 1 to 63"):
        run(inference, prompts=[[1], list(range(MAX_LENGTH))])
    with pytest.raises(GenerationInputError, match="prompt 0 has 0 tokens"):
        run(inference, prompts=[[]])
