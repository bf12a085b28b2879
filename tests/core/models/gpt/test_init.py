"""Initialisation: Megatron-DeepSpeed's sigma and sigma / sqrt(2 L) rule, and the layout-independent seeded draw.

The gathered-weights check across TP in {1, 2, 4} lives in test_gpt_model.py and across PP in {1, 2}
in test_pipeline.py (they need several processes); here: the building blocks on one process.
"""
import hashlib
import math

import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.init import (initialize_replicated_weight, parameter_seed, seeded_init_method_normal,
                                           weight_init_method)
from megatron.core.parallel_state import single_rank_groups
from megatron.core.tensor_parallel.random import model_parallel_seed
from tests.core.models.gpt.gpt_test_utils import tiny_config


def test_parameter_seed_is_a_stable_hash_of_seed_layer_and_name():
    digest = hashlib.sha256(b"1234/3/mlp.dense_h_to_4h.weight").digest()
    assert parameter_seed(1234, 3, "mlp.dense_h_to_4h.weight") == int.from_bytes(digest[:8], "little") % 2 ** 63
    seeds = {parameter_seed(s, layer, name) for s in (1, 2) for layer in (0, 1, 2)
             for name in ("a.weight", "b.weight")}
    assert len(seeds) == 12


def test_seeded_draw_is_reproducible_and_cast_from_fp32():
    init = seeded_init_method_normal(0.5, 7, 1, "w")
    first, second = torch.empty(300, 400), torch.empty(300, 400)
    init(first)
    init(second)
    assert torch.equal(first, second)
    assert abs(float(first.std()) - 0.5) < 0.01 and abs(float(first.mean())) < 0.01
    low = torch.empty(300, 400, dtype=torch.bfloat16)
    init(low)
    assert torch.equal(low, first.to(torch.bfloat16))
    other = torch.empty(300, 400)
    seeded_init_method_normal(0.5, 7, 2, "w")(other)
    assert not torch.allclose(first, other)


def test_output_projections_are_scaled_by_sqrt_2l():
    config = tiny_config(num_layers=8, hidden_size=128, use_cpu_initialization=True)
    model = GPTModel(config, single_rank_groups())
    sigma, scaled = config.init_method_std, config.init_method_std / math.sqrt(16)
    layer = model.layers[3]
    for weight, expected in ((layer.self_attention.query_key_value.weight, sigma),
                             (layer.mlp.dense_h_to_4h.weight, sigma),
                             (layer.self_attention.dense.weight, scaled),
                             (layer.mlp.dense_4h_to_h.weight, scaled),
                             (model.embedding.word_embeddings.weight, sigma),
                             (model.embedding.position_embeddings.weight, sigma)):
        assert abs(float(weight.detach().std()) / expected - 1.0) < 0.05
    for norm in (layer.input_layernorm, model.final_layernorm):
        assert torch.equal(norm.weight, torch.ones(128)) and torch.equal(norm.bias, torch.zeros(128))
    assert torch.equal(layer.mlp.dense_h_to_4h.bias, torch.zeros(512))


def test_cpu_initialization_depends_only_on_the_random_seed():
    config = tiny_config(use_cpu_initialization=True)
    first, second = GPTModel(config, single_rank_groups()), GPTModel(config, single_rank_groups())
    other_seed = GPTModel(tiny_config(use_cpu_initialization=True, seed=99), single_rank_groups())
    for (name, a), b, c in zip(first.named_parameters(), second.parameters(), other_seed.parameters()):
        assert torch.equal(a, b), name
        if name.endswith("weight") and "layernorm" not in name:
            assert not torch.equal(a, c), name
    # distinct layers get distinct weights
    assert not torch.equal(first.layers[0].mlp.dense_h_to_4h.weight, first.layers[1].mlp.dense_h_to_4h.weight)


def test_device_initialization_draws_from_the_current_generators():
    config = tiny_config(use_cpu_initialization=False)
    model_parallel_seed(5, tp_rank=0, pp_rank=0)
    first = GPTModel(config, single_rank_groups())
    model_parallel_seed(5, tp_rank=0, pp_rank=0)
    second = GPTModel(config, single_rank_groups())
    model_parallel_seed(6, tp_rank=0, pp_rank=0)
    third = GPTModel(config, single_rank_groups())
    for (name, a), b, c in zip(first.named_parameters(), second.parameters(), third.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(first.layers[0].mlp.dense_h_to_4h.weight, third.layers[0].mlp.dense_h_to_4h.weight)


def test_replicated_weight_under_cpu_initialization():
    weight = torch.empty(10, 6, dtype=torch.bfloat16)
    init = weight_init_method(tiny_config(use_cpu_initialization=True), 0, "position_embeddings.weight")
    initialize_replicated_weight(weight, init, use_cpu_initialization=True)
    expected = torch.empty(10, 6)
    init(expected)
    assert torch.equal(weight, expected.to(torch.bfloat16))
