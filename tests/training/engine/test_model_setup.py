"""model_setup: the weight-decay groups of the GPT models, Llama-class included."""
import pytest

from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.training.engine.model_setup import weight_decay_groups

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64, seq_length=16,
            max_position_embeddings=16, use_cpu_initialization=True)
LLAMA = dict(normalization="RMSNorm", num_query_groups=2, position_embedding_type="rotary", glu_activation="swiglu",
             bias_gelu_fusion=False, untie_embeddings_and_output_weights=True, add_bias_linear=False)


@pytest.mark.parametrize("options", [{}, LLAMA], ids=["gpt", "llama"])
def test_norm_weights_and_biases_take_no_weight_decay(options):
    model = GPTModel(GPTModelConfig(**TINY, **options), single_rank_groups())
    decay, no_decay = weight_decay_groups(model, 0.1)
    names = {id(param): name for name, param in model.named_parameters()}
    undecayed = sorted(names[id(param)] for param in no_decay["params"])
    expected = sorted(name for name in names.values() if "layernorm" in name or name.endswith(".bias"))
    assert undecayed == expected and (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    if options:
        assert "output_layer.weight" in {names[id(param)] for param in decay["params"]}
        assert all(name.endswith("layernorm.weight") for name in undecayed)
