"""tools/benchmarks/bench_vs_peer.py on CPU: the peer's training step learns, the ratio table."""
import dataclasses

import pytest
import torch

from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer
from megatron.core.parallel_state import single_rank_groups
from megatron.core.tensor_parallel.random import model_parallel_seed
from megatron.training.throughput import model_flops
from tests.tools.test_scaling_table import _log
from tools.benchmarks.bench_vs_peer import (MODELS, PeerModel, gpt_config, ours_best, peer_model, peer_step_seconds,
                                            ratio_rows)


def test_peer_step_trains_the_gpt2_of_our_shapes():
    shapes = PeerModel(num_layers=2, hidden_size=32, num_attention_heads=2, micro_batches=(2,), global_batch=4)
    torch.manual_seed(0)
    module = peer_model(shapes, seq_length=16, vocab_size=64, device="cpu")
    config = gpt_config(shapes, 16, 64)
    ours = sum(12 * config.hidden_size**2 + 13 * config.hidden_size for _ in range(config.num_layers))
    layers = sum(p.numel() for name, p in module.named_parameters() if ".h." in name)
    assert layers == ours  # the same transformer layers (weights, biases, two norms each)
    before = [p.detach().clone() for p in module.parameters()]
    assert peer_step_seconds(module, 2, 2, 16, 64, compile_model=False, warmup=1, iters=1) > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, module.parameters()) if p.requires_grad)


def test_llama_peer_has_our_layers_and_trains():
    shapes = dataclasses.replace(MODELS["llama1p2b"], num_layers=2, hidden_size=32, num_attention_heads=4,
                                 ffn_hidden_size=48, num_query_groups=2, global_batch=2)
    torch.manual_seed(0)
    module = peer_model(shapes, seq_length=16, vocab_size=64, device="cpu")
    model_parallel_seed(1234, 0, 0)
    ours = ParallelTransformerLayer(gpt_config(shapes, 16, 64), 1, single_rank_groups(), device="cpu")
    per_layer = {name: p.numel() for name, p in module.named_parameters() if ".layers.0." in name}
    assert sum(per_layer.values()) == sum(p.numel() for p in ours.parameters())  # RMSNorm, GQA, SwiGLU, no biases
    assert per_layer["model.layers.0.self_attn.k_proj.weight"] == 32 * 2 * 8  # g x hn key rows
    assert module.lm_head.weight is not module.model.embed_tokens.weight  # untied
    before = [p.detach().clone() for p in module.parameters()]
    assert peer_step_seconds(module, 1, 2, 16, 64, compile_model=False, warmup=1, iters=1) > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, module.parameters()))


def test_llama_flops_are_megatron_lms_count():
    model = MODELS["llama1p2b"]
    config = gpt_config(model, model.seq_length, model.padded_vocab_size)
    b, s, L, h, f, V = 16, 4096, 16, 2048, 8192, 128256
    p, k = h, 8 * (h // 32)  # n hn and g hn
    expected = 3 * b * s * (L * (4 * h * p + 4 * h * k + 4 * s * p + 2 * h * f * 3) + 2 * h * V)
    assert model_flops(config, b, s) == expected


def test_ratio_rows():
    rows = ratio_rows([("1p3b", 530.0, 424.0, 8), ("350m", 400.0, 0.0, 0)])
    assert rows[2] == "| 1p3b | 530.0 | 424.0 | 8 | 1.25x |"
    assert rows[3].endswith("| peer ran out of memory |")


def test_ours_is_the_best_of_its_micro_batches(tmp_path, capsys):
    slow = _log(tmp_path, "mbs8", [(1.0, 100.0)] * 3 + [(1.0, 500.0), (1.0, 520.0)])  # mean 510 after 3
    fast = _log(tmp_path, "mbs16", [(1.0, 900.0)] * 3 + [(1.0, 530.0), (1.0, 540.0)])  # mean 535
    assert ours_best("1p3b", [slow, fast], skip=3) == pytest.approx(535.0)
    assert ours_best("1p3b", [slow], skip=3) == pytest.approx(510.0)
    assert "mbs16.log: 535.0 model TFLOP/s" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="none of .* has an iteration line after iteration 5"):
        ours_best("1p3b", [slow], skip=5)
    out_of_memory = _log(tmp_path, "mbs32", [(1.0, 900.0)] * 2)  # stopped before the steady state
    assert ours_best("1p3b", [slow, out_of_memory], skip=3) == pytest.approx(510.0)
    assert "mbs32.log: no iteration line after iteration 3" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="cannot read the trainer log 'missing.log'"):
        ours_best("1p3b", [slow, "missing.log"], skip=3)
