"""The tiny models and runs the text generation tests share."""
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core.text_generation.forward import PipelineForward
from megatron.core.text_generation.generation import generate
from megatron.core.text_generation.sampling import SamplingParams
from megatron.core.text_generation.stage_model import InferenceStage
from tests.core.models.gpt.gpt_test_utils import randomize_parameters, tiny_config

VOCAB, PADDED_VOCAB, EOD, MAX_LENGTH = 100, 128, 99, 64
PROMPTS = [[5, 17, 42], [8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [3, 3, 3, 3, 3], [90, 12, 7, 33, 21, 50]]
NEW_TOKENS = 32
GREEDY = SamplingParams(greedy=True)
OPTIONS = {"learned": dict(),
           "rotary + swiglu": dict(position_embedding_type="rotary", glu_activation="swiglu", bias_gelu_fusion=False),
           "alibi + embedding LN + fp32 residual": dict(position_embedding_type="alibi", embed_layernorm=True,
                                                          fp32_residual_connection=True),
           "llama: RMSNorm, GQA, swiglu, untied, no bias": dict(
               position_embedding_type="rotary", rotary_base=500000.0, normalization="RMSNorm", num_attention_heads=8,
               num_query_groups=2, glu_activation="swiglu", bias_gelu_fusion=False, ffn_hidden_size=48,
               untie_embeddings_and_output_weights=True, add_bias_linear=False)}


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



def cached_logits_in_chunks(inference: PipelineForward, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [b, 40] fed to a fresh cache in chunks (a prompt, one-token steps, longer chunks) -> logits [b, 40, V]."""
    caches, chunks = inference.new_caches(tokens.shape[0], 40), []
    for start, end in ((0, 7), (7, 8), (8, 9), (9, 25), (25, 26), (26, 27), (27, 40)):
        chunks.append(inference.last_stage_logits(tokens[:, start:end], start, caches))
    return torch.cat(chunks, dim=1)
