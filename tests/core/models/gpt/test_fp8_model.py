"""GPTModel under FP8 (GPTModelConfig.fp8): the four linear layers of each transformer layer run their
GEMMs in FP8 (the CPU emulation here), except in the layers kept in the model's precision; embeddings
and the output layer never do."""
import pytest
import torch

from megatron.core.models.gpt.config import GPTConfigError
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core.tensor_parallel.fp8 import DelayedScaling, Fp8Config
from megatron.core.tensor_parallel.fp8_linear import Fp8Gemms, end_fp8_step
from tests.core.models.gpt.gpt_test_utils import random_tokens, tiny_config

FP8 = Fp8Config(format="hybrid", recipe="tensorwise", emulate=True)
LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def fp8_modules(model) -> set[str]:
    return {name.removesuffix(".fp8_gemms") for name, module in model.named_modules() if isinstance(module, Fp8Gemms)}


def test_every_transformer_linear_layer_and_nothing_else_runs_in_fp8():
    model = GPTModel(tiny_config(num_layers=3, fp8=FP8), single_rank_groups())
    assert fp8_modules(model) == {f"layers.{index}.{linear}" for index in range(3) for linear in LINEARS}


def test_first_and_last_layers_keep_the_model_precision():
    config = tiny_config(num_layers=4, fp8=FP8, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    model = GPTModel(config, single_rank_groups())
    assert fp8_modules(model) == {f"layers.{index}.{linear}" for index in (1, 2) for linear in LINEARS}


def test_fp8_forward_and_backward_stay_close_to_the_model_without_it():
    """Same weights: FP8 (hybrid, tensorwise) changes the loss and the gradients a little, not a lot."""
    torch.manual_seed(0)
    plain = GPTModel(tiny_config(), single_rank_groups())
    fp8 = GPTModel(tiny_config(fp8=FP8), single_rank_groups())
    fp8.load_state_dict(plain.state_dict())
    tokens = random_tokens(2, 16, 64)
    losses = []
    for model in (plain, fp8):
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[0] != losses[1] and losses[1] == pytest.approx(losses[0], rel=2e-2)
    for (name, a), (_, b) in zip(plain.named_parameters(), fp8.named_parameters()):
        assert (b.grad - a.grad).norm() <= 0.15 * a.grad.norm() + 1e-6, name
    assert end_fp8_step(fp8, [None]) is None  # no delayed scaling: nothing to count


@pytest.mark.parametrize("overrides, words", [
    (dict(num_layers_at_start_in_bf16=1), ["--first-last-layers-bf16", "--fp8-format"]),
    (dict(fp8=FP8, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1), ["none of the --num-layers (2)"]),
    (dict(fp8=FP8, num_layers_at_start_in_bf16=-1), ["must be >= 0"]),
])
def test_config_refusals(overrides, words):
    with pytest.raises(GPTConfigError) as info:
        tiny_config(**overrides)
    assert all(word in str(info.value) for word in words)


def _fp8_state(model) -> dict:
    """The saved FP8 entries (histories and scales; the inverse scales are derived, not saved)."""
    return {name: value for name, value in model.state_dict(keep_vars=True).items() if "fp8_gemms" in name}


def _filled_delayed_model(**overrides):
    model = GPTModel(tiny_config(fp8=Fp8Config(recipe="delayed", emulate=True), **overrides), single_rank_groups())
    for buffer in _fp8_state(model).values():
        buffer.data.fill_(3.0)
    return model


def test_delayed_scaling_state_round_trips_through_the_state_dict():
    saved = _filled_delayed_model()
    loaded = GPTModel(tiny_config(fp8=Fp8Config(recipe="delayed", emulate=True)), single_rank_groups())
    loaded.load_state_dict(saved.state_dict())
    assert _fp8_state(saved).keys() == _fp8_state(loaded).keys()
    assert all(torch.equal(value, _fp8_state(loaded)[name]) for name, value in _fp8_state(saved).items())
    states = [module for module in loaded.modules() if isinstance(module, DelayedScaling)]
    assert states and all(state.has_scales and torch.equal(torch.stack(state.inverses()), torch.full((3,), 1 / 3.0))
                          for state in states)


@pytest.mark.parametrize("fp8", [None, Fp8Config(recipe="tensorwise", emulate=True),
                                 Fp8Config(recipe="delayed", amax_history_len=4, emulate=True)])
def test_fp8_state_that_does_not_fit_is_dropped_and_the_weights_load(fp8):
    saved = _filled_delayed_model()
    loaded = GPTModel(tiny_config(fp8=fp8), single_rank_groups())
    fresh = {name: buffer.clone() for name, buffer in loaded.named_buffers() if "fp8_gemms" in name}
    loaded.load_state_dict(saved.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), loaded.parameters()))
    assert all(torch.equal(buffer, fresh[name]) for name, buffer in loaded.named_buffers() if "fp8_gemms" in name)


def test_a_state_without_fp8_loads_into_a_delayed_scaling_model_keeping_its_own_scales():
    plain = GPTModel(tiny_config(), single_rank_groups())
    loaded = _filled_delayed_model()
    loaded.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), loaded.parameters()))
    assert all(torch.equal(buffer, torch.full_like(buffer, 3.0)) for buffer in _fp8_state(loaded).values())
