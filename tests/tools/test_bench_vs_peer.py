"""tools/benchmarks/bench_vs_peer.py on CPU: the peer's training step learns, the ratio table."""
import torch

from tools.benchmarks.bench_vs_peer import PeerModel, gpt_config, peer_model, peer_step_seconds, ratio_rows


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


def test_ratio_rows():
    rows = ratio_rows([("1p3b", 530.0, 424.0, 8), ("350m", 400.0, 0.0, 0)])
    assert rows[2] == "| 1p3b | 530.0 | 424.0 | 8 | 1.25x |"
    assert rows[3].endswith("| peer ran out of memory |")
