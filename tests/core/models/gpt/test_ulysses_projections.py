"""DeepSpeed-Ulysses with the exchanges beside the projections (ulysses_projections.overlapped_attention) on 2
gloo ranks, float64, against the one-process projections and a stand-in attention that mixes the whole
sequence per head: outputs, the input's gradient, and the weights' gradients (each rank's a partial sum over
its positions), returned or added into a ``main_grad``, with and without the projection's bias, with
multi-head and grouped-query attention; on two GPUs the same in bf16 (fp32 main_grad) with NCCL's exchange
and with the peer-memory one. The model-level parity (rotary, ALiBi, recompute) is in test_ulysses.py."""
import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt import ulysses
from megatron.core.models.gpt.ulysses_projections import HeadLayout, overlapped_attention
from megatron.core.tensor_parallel.async_tp import peer_memory_reaches
from tests.dist_utils import run_distributed

SEQ, BATCH, HIDDEN, HEAD_DIM = 8, 2, 6, 3


def _stand_in_attention(first_head: int, queries_per_group: int):
    """(query [s, b, heads, hn], key, value [s, b, groups, hn]) -> [s, b, heads hn]: head i (global index
    first_head + i) reads group i // q; cumsum over the sequence so every position matters."""
    def attend(query, key, value):
        key, value = (t.repeat_interleave(queries_per_group, dim=2) for t in (key, value))
        factors = torch.arange(first_head + 1, first_head + query.shape[2] + 1, dtype=query.dtype,
                               device=query.device)
        return ((query * key.tanh()).cumsum(0) * factors[:, None] + value).flatten(-2)
    return attend


def _reference(x, weight, bias, dense_weight, layout):
    """The one-process projections and stand-in attention: dense's output [s, b, h]."""
    mixed = torch.nn.functional.linear(x, weight, bias).unflatten(-1, (layout.groups, -1))  # [s, b, G, (q + 2) hn]
    q, hn = layout.queries_per_group, layout.head_dim
    query = mixed[..., :q * hn].reshape(*x.shape[:2], -1, hn)
    key, value = mixed[..., q * hn:(q + 1) * hn], mixed[..., (q + 1) * hn:]
    return _stand_in_attention(0, q)(query, key, value).matmul(dense_weight.t())


def _close(found: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within float64 rounding, or for bf16 within a normwise 1e-2."""
    if found.dtype == torch.float64:
        torch.testing.assert_close(found, expected)
    else:
        error = (found.double() - expected.double()).norm() / expected.double().norm()
        assert error < 1e-2, f"normwise error {error:.2e}"


def _worker(rank, world_size, groups, queries_per_group, with_bias, with_main_grad, exchange="nccl"):
    """On gloo in float64; on NCCL (one GPU per rank) in bf16 with ``exchange`` (ulysses.EXCHANGE; "auto" takes
    peer memory between two GPUs of one host)."""
    layout = HeadLayout(groups, queries_per_group, HEAD_DIM)
    heads = groups * queries_per_group
    generator = torch.Generator().manual_seed(3)
    on_gpu = dist.get_backend() == "nccl"
    device, dtype = (torch.device("cuda", rank), torch.bfloat16) if on_gpu else (torch.device("cpu"), torch.float64)
    ulysses.EXCHANGE = exchange
    if on_gpu and exchange == "auto":
        assert peer_memory_reaches(dist.group.WORLD)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype)

    x_full, grad_full = randn(SEQ, BATCH, HIDDEN), randn(SEQ, BATCH, HIDDEN)
    weight = randn(groups * (queries_per_group + 2) * HEAD_DIM, HIDDEN).requires_grad_()
    bias = randn(weight.shape[0]).requires_grad_() if with_bias else None
    dense_weight = randn(HIDDEN, heads * HEAD_DIM).requires_grad_()
    leaf = x_full.clone().requires_grad_()
    expected = _reference(leaf, weight, bias, dense_weight, layout)
    expected.backward(grad_full)
    references = [weight.grad, dense_weight.grad] + ([bias.grad] if with_bias else [])
    for param in (weight, dense_weight, bias):
        if param is not None:
            param.grad = None
            if with_main_grad and param is not bias:
                param.main_grad = torch.zeros_like(param, dtype=torch.float32 if on_gpu else param.dtype)

    mine = slice(rank * SEQ // world_size, (rank + 1) * SEQ // world_size)
    x = x_full[mine].clone().requires_grad_()
    first_head = rank * heads // world_size
    output = overlapped_attention(x, weight, bias, dense_weight, _stand_in_attention(first_head, queries_per_group),
                                  layout, dist.group.WORLD)
    _close(output, expected.detach()[mine])
    output.backward(grad_full[mine])
    _close(x.grad, leaf.grad[mine])
    if with_main_grad:
        assert weight.grad is None and dense_weight.grad is None
        found = [weight.main_grad, dense_weight.main_grad]
    else:
        found = [weight.grad, dense_weight.grad]
    found += [bias.grad] if with_bias else []
    for partial, reference in zip(found, references):
        total = partial.clone()
        dist.all_reduce(total)  # each rank's is the sum over its positions
        _close(total.to(reference.dtype), reference)
    with torch.no_grad():
        again = overlapped_attention(x, weight, bias, dense_weight, _stand_in_attention(first_head, queries_per_group),
                                     layout, dist.group.WORLD)
    torch.testing.assert_close(again, output.detach())


@pytest.mark.distributed
@pytest.mark.parametrize("groups, queries_per_group, with_bias, with_main_grad", [
    (4, 1, True, False),  # multi-head with the projection's bias
    (4, 1, False, True),  # gradients added into main_grad
    (2, 3, True, True),  # grouped-query: 2 groups of 3 query heads, one group per rank
])
def test_overlapped_attention_matches_the_one_process_projections(groups, queries_per_group, with_bias,
                                                                  with_main_grad):
    run_distributed(_worker, 2, groups, queries_per_group, with_bias, with_main_grad)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("exchange", ["nccl", "peer", "auto"])
def test_overlapped_attention_on_two_gpus(exchange):
    run_distributed(_worker, 2, 4, 2, True, True, exchange, backend="nccl")
