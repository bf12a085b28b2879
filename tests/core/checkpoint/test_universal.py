"""The universal_checkpoint_info patterns come from the model: each parameter matches the patterns of
its split and no other, and every pattern matches a parameter (DeepSpeed refuses one that does not)."""
import re

import pytest

from megatron.core.checkpoint.names import pipeline_name
from megatron.core.checkpoint.sharding import ModelSharding
from megatron.core.checkpoint.universal import universal_info
from tests.core.models.gpt.gpt_test_utils import tiny_config

KINDS = {"vocabulary_parameter_patterns": lambda split: split.vocabulary,
         "parameter_to_average_patterns": lambda split: split.replicated,
         "parameter_with_row_parallelism_patterns": lambda split: split.dim == 1,
         "parameter_with_2_sub_params_cat_dim_0": lambda split: split.stride == 2}
# the final norm (L + 4) and the untied output layer (L + 5) both hold a "weight": one averaged, one
# vocabulary-split, so their patterns must keep the layer index
LLAMA = {"glu_activation": "swiglu", "bias_gelu_fusion": False, "position_embedding_type": "rotary",
         "normalization": "RMSNorm", "num_query_groups": 1, "untie_embeddings_and_output_weights": True,
         "add_bias_linear": False}


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("options", [{}, {"glu_activation": "swiglu", "bias_gelu_fusion": False, "embed_layernorm": True,
                                          "position_embedding_type": "rotary"}, LLAMA], ids=["gpt", "glu", "llama"])
def test_each_parameter_matches_the_patterns_of_its_split(pipeline, options):
    sharding = ModelSharding(tiny_config(**options))
    info = universal_info(sharding, pipeline, padded_vocab_size=64, original_vocab_size=50)
    names = {pipeline_name(name, 2) if pipeline else name: split for name, split in sharding.splits.items()}
    for kind, wanted in KINDS.items():
        for name, split in names.items():
            assert any(re.match(pattern, name) for pattern in info[kind]) == wanted(split), (kind, name)
        for pattern in info[kind]:
            assert any(re.match(pattern, name) for name in names), (kind, pattern)
    assert (info["padded_vocab_size"], info["original_vocab_size"]) == (64, 50)
    assert bool(info["parameter_with_2_sub_params_cat_dim_0"]) == ("glu_activation" in options)
