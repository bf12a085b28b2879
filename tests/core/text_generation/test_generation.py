"""Generation with and without the key/value cache, against transformers' ``generate`` and the
training model.

* Greedy, 32 new tokens for 5 prompts of different lengths in one batch: token for token what
  transformers' GPT2LMHeadModel (learned positions) and BloomForCausalLM (ALiBi, embedding LayerNorm)
  generate from the same weights, one prompt at a time; with the growing cache, the static one (the
  CUDA-graph path's) and without a cache (--recompute).
* For every position option we train (learned, rotary, ALiBi) with a GLU, an embedding LayerNorm and
  fp32 residuals: the logits of a cached run (either cache), fed in chunks, equal GPTModel's logits
  of the whole sequence; the batched greedy output equals GPTModel's step-by-step argmax of each prompt alone.
* Sampling under a seed repeats, and the cache does not change which tokens a seed draws.
"""
import dataclasses

import pytest
import torch

from megatron.core import fused_kernels
from megatron.core.checkpoint.names import pipeline_name
from megatron.core.checkpoint.transformers_export import exported_layer, transformers_config
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core.text_generation.forward import PipelineForward
from megatron.core.text_generation.generation import GenerationInputError, generate
from megatron.core.text_generation.sampling import SamplingParams
from megatron.core.text_generation.stage_model import InferenceStage
from tests.core.models.gpt.gpt_test_utils import randomize_parameters, tiny_config

transformers = pytest.importorskip("transformers")

VOCAB, PADDED_VOCAB, EOD, MAX_LENGTH = 100, 128, 99, 64
PROMPTS = [[5, 17, 42], [8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [3, 3, 3, 3, 3], [90, 12, 7, 33, 21, 50]]
NEW_TOKENS = 32
GREEDY = SamplingParams(greedy=True)
OPTIONS = {"learned": dict(),
           "rotary + swiglu": dict(position_embedding_type="rotary", glu_activation="swiglu", bias_gelu_fusion=False),
           "alibi + embedding LN + fp32 residual": dict(position_embedding_type="alibi", embed_layernorm=True,
                                                          fp32_residual_connection=True)}


def tiny_model(seed: int = 1, **options) -> GPTModel:
    config = tiny_config(padded_vocab_size=PADDED_VOCAB, seq_length=MAX_LENGTH, max_position_embeddings=MAX_LENGTH,
                         num_layers=3, **options)
    model = GPTModel(config, single_rank_groups())
    randomize_parameters(model, seed=seed, scale=0.3)
    return model.eval()


def inference_of(model: GPTModel, static_cache: bool = False, compiled_decode: bool = False) -> PipelineForward:
    stage = InferenceStage(model.config, single_rank_groups())
    stage.load_state_dict(model.state_dict())
    return PipelineForward(stage, single_rank_groups(), static_cache=static_cache, compiled_decode=compiled_decode)


def run(model: PipelineForward, params=GREEDY, use_cache=True, generator=None, prompts=PROMPTS):
    return generate(model, prompts, NEW_TOKENS, params, eod=EOD, vocab_size=VOCAB, max_length=MAX_LENGTH,
                    use_cache=use_cache, generator=generator)


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


def cached_logits_in_chunks(inference: PipelineForward, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [b, 40] fed to a fresh cache in chunks (a prompt, one-token steps, longer chunks) -> logits [b, 40, V]."""
    caches, chunks = inference.new_caches(tokens.shape[0], 40), []
    for start, end in ((0, 7), (7, 8), (8, 9), (9, 25), (25, 26), (26, 27), (27, 40)):
        chunks.append(inference.last_stage_logits(tokens[:, start:end], start, caches))
    return torch.cat(chunks, dim=1)


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
                   "alibi, embedding LN": dict(position_embedding_type="alibi", embed_layernorm=True)}


@pytest.mark.parametrize("name", ONE_ROW_OPTIONS)
def test_one_row_steps_take_the_fused_layer_path_and_equal_the_training_model(name, monkeypatch):
    """One-token steps of one sequence over the static cache run each layer as layer_norm_linear,
    attention, linear + residual, layer_norm_linear + activation, linear + residual (the kernels of
    a GPU); their logits are the training model's, and batch 1 generates what batch 5 does."""
    fused_calls = []
    fused = fused_kernels.layer_norm_linear
    monkeypatch.setattr(fused_kernels, "layer_norm_linear",
                        lambda *args: fused_calls.append(args[6] if len(args) > 6 else "qkv") or fused(*args))
    model = tiny_model(seed=8, **ONE_ROW_OPTIONS[name])
    inference = inference_of(model, static_cache=True)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens).float()
    torch.testing.assert_close(cached_logits_in_chunks(inference, tokens), expected, rtol=1e-5, atol=5e-5)
    activation = "gelu" if name == "rotary, erf GeLU" else "gelu_tanh"
    assert fused_calls == ["qkv", activation] * (4 * 3)  # 4 one-token steps of 3 layers
    fused_calls.clear()
    batched = run(inference)
    assert fused_calls == []  # five rows: forward's path
    for row, prompt in enumerate(PROMPTS):
        assert run(inference, prompts=[prompt]).continuation(0) == batched.continuation(row)
    assert fused_calls


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
