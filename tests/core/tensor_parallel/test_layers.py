"""Tensor-parallel layers (megatron/core/tensor_parallel/layers.py) against their TP=1 torch equivalents."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.random import get_rng_tracker, model_parallel_seed
from tests.autograd_utils import saved_tensors
from tests.dist_utils import run_distributed

IN, OUT, VOCAB, HIDDEN = 8, 12, 16, 6
SEQ, BATCH = 5, 3
SEED = 1234
init_normal = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.5)


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _master_weight(shape):
    """The full weight that use_cpu_initialization builds from the default generator seeded with SEED."""
    torch.manual_seed(SEED)
    weight = torch.empty(shape)
    init_normal(weight)
    return weight


def _gather(tensor, dim, group):
    """Concatenate the TP ranks' slices along ``dim`` (test-side, plain all_gather)."""
    if group is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _chunk(tensor, dim, k, me):
    return tensor.chunk(k, dim=dim)[me]


def assert_normwise_close(actual, expected, tol=1e-5):
    error = (actual - expected).norm() / expected.norm()
    assert error <= tol, f"normwise error {error:.3e} > {tol}"


def _reference_linear(weight, bias, x, grad_y):
    """y = x W^T + b and the gradients of <y, grad_y> w.r.t. x, W, b."""
    x, weight, bias = (t.clone().requires_grad_(True) for t in (x, weight, bias))
    y = F.linear(x, weight, bias)
    y.backward(grad_y)
    return y.detach(), x.grad, weight.grad, bias.grad


def _check_column(group, k, me):
    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(IN, OUT, tp_group=group, init_method=init_normal, use_cpu_initialization=True)
    weight, bias = _master_weight((OUT, IN)), _randn(OUT, seed=1)
    assert torch.equal(_gather(layer.weight.detach(), 0, group), weight)  # same full weight for every TP
    assert (layer.weight.tensor_model_parallel, layer.weight.partition_dim, layer.weight.partition_stride) == (
        True, 0, 1)
    with torch.no_grad():
        layer.bias.copy_(_chunk(bias, 0, k, me))
    x, grad_y = _randn(SEQ, BATCH, IN, seed=2), _randn(SEQ, BATCH, OUT, seed=3)
    y_ref, gx_ref, gw_ref, gb_ref = _reference_linear(weight, bias, x, grad_y)
    for gather_output in (False, True):
        layer.gather_output = gather_output
        layer.zero_grad()
        x_in = x.clone().requires_grad_(True)
        y, returned_bias = layer(x_in)
        assert returned_bias is None
        expected_y, local_grad_y = (y_ref, grad_y) if gather_output else (
            _chunk(y_ref, -1, k, me), _chunk(grad_y, -1, k, me))
        assert y.shape == expected_y.shape
        assert_normwise_close(y.detach(), expected_y)
        y.backward(local_grad_y)
        assert_normwise_close(x_in.grad, gx_ref)
        assert_normwise_close(_gather(layer.weight.grad, 0, group), gw_ref)
        assert_normwise_close(_gather(layer.bias.grad, 0, group), gb_ref)
    layer.gather_output, layer.skip_bias_add = False, True
    y, returned_bias = layer(x)
    assert returned_bias is layer.bias
    assert_normwise_close((y + returned_bias).detach(), _chunk(y_ref, -1, k, me))


def _check_row(group, k, me):
    torch.manual_seed(SEED)
    layer = RowParallelLinear(OUT, IN, tp_group=group, init_method=init_normal, use_cpu_initialization=True)
    weight, bias = _master_weight((IN, OUT)), _randn(IN, seed=4)
    assert torch.equal(_gather(layer.weight.detach(), 1, group), weight)
    assert (layer.weight.partition_dim, layer.bias.tensor_model_parallel) == (1, False)
    with torch.no_grad():
        layer.bias.copy_(bias)
    x, grad_y = _randn(SEQ, BATCH, OUT, seed=5), _randn(SEQ, BATCH, IN, seed=6)
    y_ref, gx_ref, gw_ref, gb_ref = _reference_linear(weight, bias, x, grad_y)
    for input_is_parallel in (True, False):
        layer.input_is_parallel = input_is_parallel
        layer.zero_grad()
        x_in = (_chunk(x, -1, k, me) if input_is_parallel else x).clone().requires_grad_(True)
        y, returned_bias = layer(x_in)
        assert returned_bias is None
        assert_normwise_close(y.detach(), y_ref)
        y.backward(grad_y)
        assert_normwise_close(x_in.grad, _chunk(gx_ref, -1, k, me) if input_is_parallel else gx_ref)
        assert_normwise_close(_gather(layer.weight.grad, 1, group), gw_ref)
        assert_normwise_close(layer.bias.grad, gb_ref)
    layer.skip_bias_add = True
    y, returned_bias = layer(x)
    assert returned_bias is layer.bias
    assert_normwise_close((y + returned_bias).detach(), y_ref)


def _check_embedding(group, k, me):
    torch.manual_seed(SEED)
    layer = VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=group, init_method=init_normal,
                                   use_cpu_initialization=True)
    table = _master_weight((VOCAB, HIDDEN))
    assert torch.equal(_gather(layer.weight.detach(), 0, group), table)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    ids[0, :4] = torch.tensor([0, VOCAB // 4, VOCAB // 2, VOCAB - 1])  # every rank's range is hit
    grad_y = _randn(BATCH, SEQ, HIDDEN, seed=8)
    table_ref = table.clone().requires_grad_(True)
    y_ref = F.embedding(ids, table_ref)
    y_ref.backward(grad_y)
    y = layer(ids)
    assert y.shape == (BATCH, SEQ, HIDDEN)
    assert_normwise_close(y.detach(), y_ref.detach())
    y.backward(grad_y)
    assert_normwise_close(_gather(layer.weight.grad, 0, group), table_ref.grad)
    for bad in (VOCAB, -1):
        with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\)"):
            layer(torch.tensor([[1, bad]]))


def _check_sequence_parallel_pair(group, k, me, comm_overlap):
    """Column- then row-parallel layer with sequence_parallel on this rank's block of 4 positions each:
    Y_r = block r of (X W1^T + b1) W2^T + b2; the gradients equal the full computation's, and the
    column layer keeps only the input block for backward (it gathers it again there), or with
    comm_overlap the gathered input (the fused collectives' CPU path)."""
    seq = 4 * k
    torch.manual_seed(SEED)  # each layer's full weight is _master_weight's draw
    column = ColumnParallelLinear(IN, OUT, tp_group=group, init_method=init_normal, use_cpu_initialization=True,
                                  sequence_parallel=True, comm_overlap=comm_overlap)
    torch.manual_seed(SEED)
    row = RowParallelLinear(OUT, IN, tp_group=group, init_method=init_normal, use_cpu_initialization=True,
                            sequence_parallel=True, comm_overlap=comm_overlap)
    w1, b1, w2, b2 = _master_weight((OUT, IN)), _randn(OUT, seed=21), _master_weight((IN, OUT)), _randn(IN, seed=22)
    with torch.no_grad():
        column.bias.copy_(_chunk(b1, 0, k, me))
        row.bias.copy_(b2)
    assert row.bias.sequence_parallel and column.bias.tensor_model_parallel
    x, grad_y = _randn(seq, BATCH, IN, seed=23), _randn(seq, BATCH, IN, seed=24)
    leaves = [t.clone().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    y_ref = F.linear(F.linear(leaves[0], leaves[1], leaves[2]), leaves[3], leaves[4])
    y_ref.backward(grad_y)
    x_block = _chunk(x, 0, k, me).clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        hidden, _ = column(x_block)
    assert ((seq, BATCH, IN) in saved) == comm_overlap and ((4, BATCH, IN) in saved) != comm_overlap
    y, _ = row(hidden)
    assert_normwise_close(y.detach(), _chunk(y_ref.detach(), 0, k, me))
    y.backward(_chunk(grad_y, 0, k, me))
    assert_normwise_close(x_block.grad, _chunk(leaves[0].grad, 0, k, me))
    assert_normwise_close(_gather(column.weight.grad, 0, group), leaves[1].grad)
    assert_normwise_close(_gather(column.bias.grad, 0, group), leaves[2].grad)
    assert_normwise_close(_gather(row.weight.grad, 1, group), leaves[3].grad)
    bias_grad = row.bias.grad.clone()  # partial: this rank's positions only, summed over TP by the model's hook
    dist.all_reduce(bias_grad, group=group)
    assert_normwise_close(bias_grad, leaves[4].grad)


def _linear_pair(group, sequence_parallel, comm_overlap):
    """A column- then a row-parallel layer from _master_weight's draws, biases included."""
    torch.manual_seed(SEED)
    column = ColumnParallelLinear(IN, OUT, tp_group=group, init_method=init_normal, use_cpu_initialization=True,
                                  sequence_parallel=sequence_parallel, comm_overlap=comm_overlap)
    torch.manual_seed(SEED)
    row = RowParallelLinear(OUT, IN, tp_group=group, init_method=init_normal, use_cpu_initialization=True,
                            sequence_parallel=sequence_parallel, comm_overlap=comm_overlap)
    return column, row


def _check_weight_grads_accumulate_into_main_grad(group, k, me):
    """Weights with a ``main_grad`` get dW added there by their backward, over two backward passes,
    and no .grad; inputs and biases get what the same layers without main_grad give them. Every
    path: TP 1 (the local matmul), and at TP > 1 plain, sequence-parallel and comm-overlapped."""
    modes = [(False, False)] + ([(True, False), (True, True)] if group is not None else [])
    for sequence_parallel, comm_overlap in modes:
        seq = 4 * k if sequence_parallel else 4
        pairs = {fused: _linear_pair(group, sequence_parallel, comm_overlap) for fused in (False, True)}
        for layer in pairs[True]:
            layer.weight.main_grad = torch.full(layer.weight.shape, 0.25)
        inputs = {fused: [] for fused in pairs}
        for seed in (31, 32):
            x = _randn(seq // k if sequence_parallel else seq, BATCH, IN, seed=seed + 10 * me)
            grad_y = _randn(seq // k if sequence_parallel else seq, BATCH, IN, seed=seed + 100)
            for fused, (column, row) in pairs.items():
                leaf = x.clone().requires_grad_(True)
                row(column(leaf)[0])[0].backward(grad_y)
                inputs[fused].append(leaf.grad)
        for ours, theirs in zip(inputs[True], inputs[False]):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        for ours, theirs in zip(pairs[True], pairs[False]):
            assert ours.weight.grad is None
            torch.testing.assert_close(ours.weight.main_grad - 0.25, theirs.weight.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, rtol=1e-6, atol=1e-6)


def _check_bias_grad_left_to_the_caller(group, k, me):
    """``bias_grad_by_caller``: the same output, input and weight gradients, and no bias gradient (the
    caller sums it from dY), on every path: TP 1, and at TP > 1 plain, sequence-parallel, comm-overlapped."""
    modes = [(False, False)] + ([(True, False), (True, True)] if group is not None else [])
    for sequence_parallel, comm_overlap in modes:
        x = _randn(4, BATCH, IN, seed=41 + 10 * me)
        grad_y = _randn(4 * k if sequence_parallel else 4, BATCH, OUT // k, seed=42 + 10 * me)
        results = []
        for by_caller in (False, True):
            column, _ = _linear_pair(group, sequence_parallel, comm_overlap)
            leaf = x.clone().requires_grad_(True)
            y, _ = column(leaf, bias_grad_by_caller=by_caller)
            y.backward(grad_y)
            results.append((y.detach(), leaf.grad, column.weight.grad, column.bias.grad))
        (y, grad_x, grad_weight, grad_bias), (y_caller, grad_x_caller, grad_weight_caller, no_grad) = results
        assert grad_bias is not None and no_grad is None
        assert torch.equal(y_caller, y) and torch.equal(grad_x_caller, grad_x)
        assert torch.equal(grad_weight_caller, grad_weight)


def _check_column_stride(group, k, me):
    """A fused [Q; K; V] weight with stride 3: each rank holds its share of Q, of K and of V."""
    hidden = 8
    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(hidden, 3 * hidden, tp_group=group, init_method=init_normal,
                                 use_cpu_initialization=True, stride=3)
    weight = _master_weight((3 * hidden, hidden))
    q, k_, v = weight.split(hidden)
    expected = torch.cat([_chunk(part, 0, k, me) for part in (q, k_, v)])
    assert torch.equal(layer.weight.detach(), expected)
    assert layer.weight.partition_stride == 3
    x = _randn(SEQ, BATCH, hidden, seed=9)
    y, _ = layer(x)
    y_ref = F.linear(x, weight).split(hidden, dim=-1)
    assert_normwise_close(y.detach(), torch.cat([_chunk(part, -1, k, me) for part in y_ref], dim=-1))
    with pytest.raises(ValueError, match="stride"):
        ColumnParallelLinear(hidden, 3 * hidden, tp_group=group, init_method=init_normal, gather_output=True,
                             use_cpu_initialization=True, stride=3)


def _check_device_init(group, k, me):
    """Without use_cpu_initialization each slice comes from the TP rank's model-parallel stream."""
    model_parallel_seed(SEED, tp_rank=me, pp_rank=0)
    default_state = torch.get_rng_state()
    layer = ColumnParallelLinear(IN, OUT, tp_group=group, init_method=init_normal)
    assert torch.equal(torch.get_rng_state(), default_state)  # the default stream is untouched
    expected = torch.empty(OUT // k, IN)
    expected.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(SEED + 2718 + me))
    assert torch.equal(layer.weight.detach(), expected)


def _layers_world4(rank, world_size):
    pairs = [[0, 1], [2, 3]]
    pair_group = [dist.new_group(ranks) for ranks in pairs][rank // 2]
    world_group = dist.new_group(list(range(world_size)))
    for group, k, me in ((None, 1, 0), (pair_group, 2, rank % 2), (world_group, 4, rank)):
        for check in (_check_column, _check_row, _check_embedding, _check_column_stride, _check_device_init,
                      _check_weight_grads_accumulate_into_main_grad, _check_bias_grad_left_to_the_caller):
            check(group, k, me)
        if group is not None:
            for comm_overlap in (False, True):
                _check_sequence_parallel_pair(group, k, me, comm_overlap)


@pytest.mark.distributed
def test_layers_match_tp1_reference_for_tp_1_2_4():
    run_distributed(_layers_world4, 4)


def test_single_process_layers_equal_torch_modules():
    for check in (_check_column, _check_row, _check_embedding, _check_column_stride, _check_device_init,
                  _check_weight_grads_accumulate_into_main_grad, _check_bias_grad_left_to_the_caller):
        check(None, 1, 0)


def test_comm_overlap_needs_sequence_parallel():
    for layer in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(ValueError, match="sequence_parallel"):
            layer(IN, OUT, tp_group=None, init_method=init_normal, comm_overlap=True)


def test_device_init_without_seeding_names_the_fix():
    get_rng_tracker().reset()
    with pytest.raises(ValueError, match="model_parallel_seed"):
        ColumnParallelLinear(IN, OUT, tp_group=None, init_method=init_normal)


def test_invalid_column_options():
    with pytest.raises(ValueError, match="skip_bias_add"):
        ColumnParallelLinear(IN, OUT, tp_group=None, init_method=init_normal, use_cpu_initialization=True,
                             gather_output=True, skip_bias_add=True)


@pytest.mark.gpu
def test_cuda_weight_gradients_accumulate_unrounded_in_fp32():
    """On CUDA the GEMM adds dW into the fp32 main_grad with fp32 output: over three bf16 backward
    passes main_grad matches the fp32 sum of the dWs far closer than the bf16-rounded dWs do."""
    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(512, 256, tp_group=None, init_method=init_normal, use_cpu_initialization=True,
                                 params_dtype=torch.bfloat16, device="cuda")
    layer.weight.main_grad = torch.zeros(layer.weight.shape, device="cuda")
    exact = torch.zeros(layer.weight.shape, dtype=torch.float64, device="cuda")
    rounded = torch.zeros(layer.weight.shape, device="cuda")
    for seed in range(3):
        x = _randn(64, 4, 512, seed=seed).to("cuda", torch.bfloat16)
        grad_y = _randn(64, 4, 256, seed=seed + 10).to("cuda", torch.bfloat16)
        layer(x)[0].backward(grad_y)
        product = grad_y.reshape(-1, 256).double().t() @ x.reshape(-1, 512).double()
        exact += product
        rounded += product.to(torch.bfloat16).float()
    assert layer.weight.grad is None and layer.weight.main_grad.dtype == torch.float32
    fused_error = (layer.weight.main_grad.double() - exact).norm() / exact.norm()
    rounded_error = (rounded.double() - exact).norm() / exact.norm()
    assert fused_error < 1e-5 and fused_error < rounded_error / 10, (fused_error, rounded_error)


@pytest.mark.parametrize("layer_class", [ColumnParallelLinear, RowParallelLinear])
def test_a_weight_released_after_use_is_saved_as_itself(layer_class):
    """ZeRO-3 frees a gathered weight by replacing its data after the forward, and gathers it again for
    backward: the graph must hold the parameter, not a view of the data it had (torch's own linear keeps
    W^T), or every layer's gathered weights stay alive until backward. Gradients stay torch's."""
    layer = layer_class(IN, OUT, tp_group=None, init_method=init_normal, use_cpu_initialization=True)
    reference = torch.nn.Linear(IN, OUT)
    reference.weight.data.copy_(layer.weight.data)
    reference.bias.data.copy_(layer.bias.data)
    x = torch.randn(5, 2, IN, requires_grad=True)
    torch_saved = saved_tensors(reference(x).grad_fn)
    assert any(t.data_ptr() == reference.weight.data_ptr() and t is not reference.weight for t in torch_saved)

    layer.weight.released_after_use = True
    output, bias = layer(x)
    output = output if bias is None else output + bias
    gathered = layer.weight.data
    layer.weight.data = torch.empty(0)  # released, as ZeRO-3 does after the layer's forward
    assert all(t.data_ptr() != gathered.data_ptr() for t in saved_tensors(output.grad_fn) if t.numel())
    layer.weight.data = gathered  # gathered again for backward
    grad = torch.randn(5, 2, OUT)
    output.backward(grad)
    reference(x).backward(grad)
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)
