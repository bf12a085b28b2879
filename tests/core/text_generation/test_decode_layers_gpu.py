"""Decode steps on CUDA take the Triton decode attention (not its reference) for every position option,
the Llama-class model (fused rotary, grouped caches) included, and equal the training model."""
import pytest
import torch

from megatron.core.fused_kernels import reference
from megatron.core.parallel_state import single_rank_groups
from megatron.core.text_generation.forward import PipelineForward
from megatron.core.text_generation.stage_model import InferenceStage
from tests.core.text_generation.generation_test_utils import OPTIONS, VOCAB, tiny_model

pytestmark = pytest.mark.gpu


def _forbidden(*args, **kwargs):
    raise AssertionError("decode_attention took its reference")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", OPTIONS)
def test_one_token_steps_take_the_decode_attention_kernel(name, batch, monkeypatch):
    model = tiny_model(seed=3, **OPTIONS[name]).cuda()
    tokens = torch.randint(0, VOCAB, (batch, 24), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        expected = model(tokens).float()
    stage = InferenceStage(model.config, single_rank_groups(), device="cuda")
    stage.load_state_dict(model.state_dict())
    inference = PipelineForward(stage, single_rank_groups(), static_cache=True)
    monkeypatch.setattr(reference, "decode_attention_reference", _forbidden)
    caches = inference.new_caches(batch, 24, device=tokens.device)
    chunks = [inference.last_stage_logits(tokens[:, :8], 0, caches)]
    chunks += [inference.last_stage_logits(tokens[:, p:p + 1], p, caches) for p in range(8, 24)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), expected, rtol=1e-4, atol=2e-4)
