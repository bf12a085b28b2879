"""Activation recompute in the GPT model: every mode gives the loss of no recompute bit for bit with
dropout on and its gradients to 1e-6 (bit for bit but where a sum's terms come in another order), also
under TP and sequence parallelism; full recompute runs the chunks its method names; selective recompute
really frees what it recomputes (the bytes autograd keeps drop by those tensors' sizes); and
CheckpointWithoutOutput frees and refills its output around the consumer's backward."""
import dataclasses
import weakref

import pytest
import torch

from megatron.core.models.gpt.config import GPTConfigError
from megatron.core.models.gpt.gpt_model import recompute_chunks
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel.random import (MODEL_PARALLEL_RNG, CheckpointWithoutOutput, get_rng_tracker,
                                                  model_parallel_seed)
from tests.core.models.gpt.gpt_test_utils import random_tokens, tiny_config
from tests.core.models.gpt.test_gpt_model import LLAMA, _check_parity, _parity_batches, build, loss_and_grads
from tests.dist_utils import run_distributed
from tools.benchmarks.recompute_saved_bytes import measure

MODES = {
    "full-uniform-2": dict(checkpoint_activations=True, checkpoint_num_layers=2),
    "full-block-1": dict(checkpoint_activations=True, recompute_method="block", checkpoint_num_layers=1),
    "full-block-3": dict(checkpoint_activations=True, recompute_method="block", checkpoint_num_layers=3),
    "core_attn": dict(recompute_modules=("core_attn",)),
    "layernorm": dict(recompute_modules=("layernorm",)),
    "mlp_act": dict(recompute_modules=("mlp_act",)),
    "mlp": dict(recompute_modules=("mlp",)),
    "selective-all": dict(recompute_modules=("core_attn", "layernorm", "mlp_act", "mlp")),
    "selective-block-2": dict(recompute_modules=("core_attn", "layernorm", "mlp_act"), recompute_method="block",
                              checkpoint_num_layers=2),
}


@pytest.mark.parametrize("variant", [dict(attention_impl="sdpa"), dict(attention_impl="materialized"),
                                     dict(position_embedding_type="rotary", glu_activation="swiglu",
                                          bias_gelu_fusion=False, normalization="RMSNorm")],
                         ids=["sdpa-gelu", "materialized-gelu", "rotary-swiglu-rmsnorm"])
def test_every_mode_gives_the_gradients_of_no_recompute_with_dropout(variant):
    config = tiny_config(num_layers=3, hidden_dropout=0.2, attention_dropout=0.2, seq_length=15, **variant)
    tokens = random_tokens(2, 16, 64, seed=6)
    loss, grads = loss_and_grads(build(config, seed=7).train(), tokens, seed=8)
    with torch.no_grad():
        assert abs(float(build(config, seed=7).eval()(tokens[:, :-1], labels=tokens[:, 1:])) - float(loss)) > 1e-3
    for name, mode in MODES.items():
        recomputed_loss, recomputed_grads = loss_and_grads(build(dataclasses.replace(config, **mode), seed=7).train(),
                                                           tokens, seed=8)
        assert torch.equal(loss, recomputed_loss), name
        for parameter, grad in grads.items():  # the same terms, summed in another order in places
            torch.testing.assert_close(recomputed_grads[parameter], grad, rtol=0, atol=1e-6 * float(grad.abs().max()),
                                       msg=f"{name}: {parameter}")


def test_recompute_chunks_of_each_method():
    uniform = tiny_config(num_layers=5, checkpoint_activations=True, checkpoint_num_layers=2)
    assert recompute_chunks(uniform, 5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    block = dataclasses.replace(uniform, recompute_method="block")
    assert recompute_chunks(block, 5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert recompute_chunks(dataclasses.replace(block, checkpoint_num_layers=5), 5) == [(i, i + 1, True)
                                                                                         for i in range(5)]
    assert recompute_chunks(block, 1) == [(0, 1, True)]  # a stage with fewer layers than N
    assert recompute_chunks(tiny_config(num_layers=5), 5) == [(0, 5, False)]
    assert recompute_chunks(tiny_config(num_layers=5, recompute_modules=("mlp_act",)), 5) == [(0, 5, False)]


def test_block_recompute_keeps_the_activations_of_the_layers_after_the_first_n():
    """The bytes autograd keeps for the whole model: block N keeps L - N layers' activations (and the
    inputs of the N checkpointed layers), so each layer more under recompute frees the same amount."""
    config = tiny_config(num_layers=4)
    tokens = random_tokens(2, 16, 64, seed=1)

    def kept_bytes(**mode):
        return _kept_bytes(build(dataclasses.replace(config, **mode), seed=2), tokens)

    full = [kept_bytes(checkpoint_activations=True, recompute_method="block", checkpoint_num_layers=n)
            for n in range(1, 5)]
    steps = [a - b for a, b in zip([kept_bytes()] + full, full)]
    assert all(step > 0 for step in steps) and max(steps) - min(steps) == 0
    assert full[-1] == kept_bytes(checkpoint_activations=True)  # block 4 of 4 = uniform 1


def test_selective_block_recompute_frees_in_the_first_n_layers_only():
    """Selective recompute with --recompute-method block N: layers 1..N run the modules' recompute and
    the others keep everything, so the bytes autograd keeps fall by the same amount per layer of N."""
    config = tiny_config(num_layers=4, recompute_modules=("layernorm", "mlp_act"), recompute_method="block")
    tokens = random_tokens(2, 16, 64, seed=1)
    kept = [_kept_bytes(build(dataclasses.replace(config, checkpoint_num_layers=n), seed=2), tokens)
            for n in range(1, 5)]
    none = _kept_bytes(build(tiny_config(num_layers=4), seed=2), tokens)
    steps = [a - b for a, b in zip([none] + kept, kept)]
    assert all(step > 0 for step in steps) and max(steps) == min(steps)
    assert kept[-1] == _kept_bytes(build(dataclasses.replace(config, recompute_method="uniform"), seed=2), tokens)
    model = build(dataclasses.replace(config, checkpoint_num_layers=3), seed=2)
    assert [layer.mlp.recompute_modules for layer in model.layers] == [("layernorm", "mlp_act")] * 3 + [()]


def _kept_bytes(model, tokens) -> int:
    """The bytes of the tensors autograd keeps for the backward of one training forward, parameters aside."""
    storages = {}

    def pack(tensor):
        storages.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.train()(tokens[:, :-1], labels=tokens[:, 1:])
    parameters = {p.data_ptr() for p in model.parameters()}
    return sum(t.untyped_storage().nbytes() for ptr, t in storages.items() if ptr not in parameters)


def test_selective_recompute_frees_what_it_recomputes():
    """Bytes kept for backward by one fp32 layer (s 16, b 2, h 32, ffn 128): mlp_act frees exactly the
    activation [s, b, ffn]; layernorm the two norms' outputs [s, b, h] (and their statistics); core_attn
    at least the attention's output [s, b, h]; mlp both [s, b, ffn] tensors."""
    config = tiny_config(num_layers=1)
    s, b, h, ffn = config.seq_length, 2, config.hidden_size, config.ffn_hidden_size
    totals = {mode: sum(kept.values()) for mode, kept in measure(config, b).items()}
    freed = {mode: totals["none"] - total for mode, total in totals.items()}
    assert freed["mlp_act"] == s * b * ffn * 4
    assert 2 * s * b * h * 4 <= freed["layernorm"] <= 2 * s * b * (h + 2) * 4
    assert freed["core_attn"] >= s * b * h * 4
    assert freed["mlp"] >= 2 * s * b * ffn * 4
    assert freed["layernorm+mlp_act"] == freed["layernorm"] + freed["mlp_act"]


def _dropped_gelu(t):
    with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
        return torch.nn.functional.dropout(torch.nn.functional.gelu(t), 0.5, training=True)


def test_checkpoint_without_output_keeps_a_recipe_instead_of_its_output():
    x, weight = torch.randn(8, 16), torch.randn(16, 4)
    model_parallel_seed(3, tp_rank=0, pp_rank=0)
    plain_x, plain_weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    plain_y = _dropped_gelu(plain_x)
    (plain_y.t().t() @ plain_weight).sum().backward()

    model_parallel_seed(3, tp_rank=0, pp_rank=0)
    x.requires_grad_(), weight.requires_grad_()
    recompute = CheckpointWithoutOutput()
    y = recompute.checkpoint(_dropped_gelu, x)
    assert torch.equal(y, plain_y)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with recompute.consumers():
            z = y.t().t() @ weight  # the matmul keeps a view of y and the weight
    assert [t.shape for t in saved] == [weight.shape]  # the view went into a recipe, the rest outside
    output = weakref.ref(y)
    del y
    assert output() is None  # nothing holds the output any more (autograd would keep it alive)
    torch.rand(1000)  # the generators move on before backward: the recomputation must not see it
    z.sum().backward()
    assert torch.equal(x.grad, plain_x.grad) and torch.equal(weight.grad, plain_weight.grad)
    assert recompute.ctx is None  # the recomputation is released after f's backward


def test_checkpoint_without_output_runs_plainly_without_grad():
    recompute = CheckpointWithoutOutput()
    with torch.no_grad():
        y = recompute.checkpoint(torch.nn.functional.gelu, torch.randn(4))
        with recompute.consumers():
            y * 2
    assert recompute.function is None and y.shape == (4,)


@pytest.mark.parametrize("overrides, words", [
    (dict(recompute_method="blocks", checkpoint_activations=True), ["--recompute-method", "uniform", "block"]),
    (dict(checkpoint_activations=True, recompute_method="block", checkpoint_num_layers=3),
     ["--recompute-num-layers (3)", "--num-layers (2)"]),
    (dict(recompute_modules=("attention",)), ["--recompute-modules attention", "core_attn"]),
    (dict(recompute_modules=("mlp_act",), checkpoint_activations=True), ["selective", "full", "keep one"]),
    (dict(recompute_modules=("layernorm",), apply_residual_connection_post_layernorm=True),
     ["layernorm", "--apply-residual-connection-post-layernorm"]),
    (dict(recompute_modules=("mlp_act",), distribute_checkpointed_activations=True),
     ["--distribute-checkpointed-activations", "full recompute"]),
])
def test_config_refuses_what_cannot_work(overrides, words):
    with pytest.raises(GPTConfigError) as info:
        tiny_config(**overrides)
    assert all(word in str(info.value) for word in words), str(info.value)


# ---- tensor parallelism: the recomputation's collectives (gloo processes) ---------------------------------

TP_CONFIGS = [  # sequence 15: TP alone; 16: with sequence parallelism
    (15, dict(checkpoint_activations=True, recompute_method="block", checkpoint_num_layers=1,
              distribute_checkpointed_activations=True)),
    (15, dict(recompute_modules=("core_attn", "layernorm", "mlp_act", "mlp"))),
    (16, dict(LLAMA, sequence_parallel=True, tp_comm_overlap=True, recompute_modules=("core_attn", "layernorm",
                                                                                       "mlp_act"))),
    (16, dict(sequence_parallel=True, recompute_modules=("mlp",))),
]


def _tensor_parallel_worker(rank, world_size):
    groups = initialize_model_parallel(tensor_model_parallel_size=world_size)
    for seq_length, overrides in TP_CONFIGS:
        tokens, plain, _ = _parity_batches(seq_length)
        _check_parity(tiny_config(seq_length=seq_length, **overrides), groups, tokens, plain)


@pytest.mark.distributed
def test_recompute_under_tensor_and_sequence_parallelism_matches_one_process():
    """At TP = 2 (with --sequence-parallel and --tp-comm-overlap for the 16-position runs) block recompute with
    distributed checkpoints and selective recompute give the one-process model's loss and gradients (1e-5)."""
    run_distributed(_tensor_parallel_worker, 2)
