"""zero3: the GPT built partitioned under zero.Init holds 1 / DP of each parameter per rank and, gathered,
the weights of the same model built whole (same seed, CPU initialisation), TP slices included; its
transformer layers become DeepSpeed's leaf modules."""
import os

import pytest
import torch

from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import initialize_model_parallel
from tests.dist_utils import run_distributed

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64, seq_length=16,
            max_position_embeddings=16, use_cpu_initialization=True)
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "memory_efficient_linear": False}}


def _partitioned_model_has_the_whole_models_weights(rank, world_size, tp, untie):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from megatron.training.engine import zero3

    deepspeed.init_distributed(dist_backend="gloo")
    groups = initialize_model_parallel(tensor_model_parallel_size=tp)
    config = GPTModelConfig(**TINY, untie_embeddings_and_output_weights=untie)
    whole = GPTModel(config, groups)
    with zero3.partitioned_construction({**DS_CONFIG, "train_batch_size": groups.dp_size}, groups):
        partitioned = GPTModel(config, groups)
    zero3.register_tied_embedding(partitioned)
    expected = dict(whole.named_parameters())
    assert sorted(name for name, _ in partitioned.named_parameters()) == sorted(expected)
    for name, param in partitioned.named_parameters():
        assert zero3.is_partitioned(param) and param.numel() == 0, name
        assert param.ds_tensor.numel() == -(-expected[name].numel() // groups.dp_size), name
        assert zero3.full_numel(param) == expected[name].numel()
        assert getattr(param, "tensor_model_parallel", None) == getattr(expected[name], "tensor_model_parallel", None)
        with deepspeed.zero.GatheredParameters([param]):
            torch.testing.assert_close(param.data, expected[name].data, rtol=0, atol=0, msg=name)
    tied = partitioned.embedding.word_embeddings.weight
    assert (id(tied) in getattr(partitioned, "_external_params", {})) == (not untie)
    zero3.gather_whole_layers(partitioned)  # DeepSpeed then hooks each layer as a unit, not its modules
    assert [m for m in partitioned.modules() if deepspeed.utils.z3_leaf_module(m)] == list(partitioned.layers)


@pytest.mark.distributed
@pytest.mark.parametrize("tp, untie", [(1, False), (2, True)], ids=["dp2", "tp2-dp2-untied"])
def test_partitioned_model_has_the_whole_models_weights(tp, untie):
    run_distributed(_partitioned_model_has_the_whole_models_weights, 2 * tp, tp, untie)


def test_gradient_views_where_both_layouts_agree():
    """Two sub-groups of parameters of partition sizes (3, 2) and (4,): the accumulation buffer holds them
    back to back, the fp32 gradients at offsets (0, 3) and (0,)."""
    from megatron.training.engine.zero3 import gradient_views

    sizes, positions = [[3, 2], [4]], [[(0, 0), (0, 3)], [(1, 0)]]
    assert gradient_views(sizes, positions, [5, 4]) == [(0, 5), (5, 4)]
    assert gradient_views(sizes, [[(0, 0), (0, 4)], [(1, 0)]], [5, 4]) is None  # a gap in the fp32 gradient
    assert gradient_views(sizes, [[(0, 0), (1, 3)], [(1, 0)]], [5, 4]) is None  # another sub-group's
    assert gradient_views(sizes, positions, [6, 4]) is None  # a longer fp32 partition (padding)
