"""tools/benchmarks/bench_text_generation.py on CPU: the peers hold our weights, the bandwidth bound's bytes."""
import torch

from megatron.core.parallel_state import single_rank_groups
from megatron.core.text_generation.forward import PipelineForward
from tools.benchmarks.bench_text_generation import (build_stage, decode_bytes_per_token, ours, parse_args, theirs,
                                                     transformers_model)

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--padded-vocab-size", "96",
        "--max-positions", "32", "--dtype", "fp32"]


def test_llama_peer_gives_our_logits_and_greedy_tokens():
    args = parse_args(["--model", "llama1p2b", "--num-query-groups", "2", "--ffn-hidden-size", "80", *TINY])
    stage = build_stage(args, "cpu")
    with torch.no_grad():
        for param in stage.parameters():  # norms away from 1, so a swapped weight shows
            param.add_(0.1 * torch.randn_like(param))
    peer = transformers_model(stage, 96)
    assert type(peer).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    forward = PipelineForward(stage, single_rank_groups())
    with torch.no_grad():
        expected = forward.last_stage_logits(tokens)
        found = peer(tokens).logits
    assert torch.allclose(found, expected, rtol=1e-4, atol=1e-4)
    prompts = tokens[:, :5]
    assert torch.equal(ours(forward, prompts, 6, vocab=96)(), theirs(peer, prompts, 6, compiled=False)())


def test_gpt2_peer_gives_our_logits():
    stage = build_stage(parse_args(TINY), "cpu")
    peer = transformers_model(stage, 90)
    assert type(peer).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = PipelineForward(stage, single_rank_groups()).last_stage_logits(tokens)[..., :90]
        assert torch.allclose(peer(tokens).logits, expected, rtol=1e-4, atol=1e-4)


def test_decode_bytes_per_token():
    llama = build_stage(parse_args(["--model", "llama1p2b", "--num-query-groups", "2", "--ffn-hidden-size", "80",
                                    *TINY]), "cpu")
    weights = sum(p.numel() for p in llama.parameters()) * 4
    # the untied input table is read one row a token; keys and values: 2 L g hn positions
    assert decode_bytes_per_token(llama, 10) == weights - 95 * 64 * 4 + 2 * 2 * 2 * 16 * 10 * 4
    gpt = build_stage(parse_args(TINY), "cpu")
    weights = sum(p.numel() for p in gpt.parameters()) * 4
    # the tied word table is the output layer's weight (read whole), the position table one row
    assert decode_bytes_per_token(gpt, 10) == weights - 31 * 64 * 4 + 2 * 2 * 4 * 16 * 10 * 4
