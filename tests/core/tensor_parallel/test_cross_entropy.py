"""Vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py) against torch's."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import cross_entropy
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tests.dist_utils import run_distributed

SEQ, BATCH, VOCAB = 7, 3, 32


def assert_normwise_close(actual, expected, tol=1e-5):
    error = (actual.double() - expected.double()).norm() / expected.double().norm()
    assert error <= tol, f"normwise error {error:.3e} > {tol}"


def _inputs(scale=3.0, offset=0.0):
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=generator) * scale + offset
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    target[0, :] = torch.tensor([0, VOCAB // 2, VOCAB - 1])  # first, middle and last partitions
    grad_loss = torch.rand(SEQ, BATCH, generator=generator)
    return logits, target, grad_loss


def _reference(logits, target, grad_loss, dtype):
    """torch's cross entropy on the full logits in ``dtype``: loss [s, b] and d<loss, grad_loss>/dlogits."""
    full = logits.to(dtype, copy=True).requires_grad_(True)
    loss = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(SEQ, BATCH)
    loss.backward(grad_loss.to(dtype))
    return loss.detach(), full.grad


def _check(group, k, me, scale=3.0, offset=0.0, dtype=torch.float32, device="cpu"):
    logits, target, grad_loss = _inputs(scale, offset)
    loss_ref, grad_ref = _reference(logits, target, grad_loss, dtype)
    local = logits.chunk(k, dim=-1)[me].to(device).requires_grad_(True)  # [s, b, V/k]
    loss = vocab_parallel_cross_entropy(local, target.to(device), group)
    loss_ref, grad_ref, grad_loss = loss_ref.to(device), grad_ref.to(device), grad_loss.to(device)
    assert loss.shape == (SEQ, BATCH) and loss.dtype == torch.float32
    assert torch.isfinite(loss).all()
    assert_normwise_close(loss.detach(), loss_ref)
    loss.backward(grad_loss)
    assert torch.isfinite(local.grad).all()
    assert_normwise_close(local.grad, grad_ref.chunk(k, dim=-1)[me])


def _check_collectives_stay_small(group, k, me):
    """Only all-reduces of [s, b]-sized tensors: the [s, b, V] logits are never gathered."""
    sizes, all_reduce = [], dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("vocab_parallel_cross_entropy must not gather")

    patched = {"all_reduce": recording_all_reduce, "all_gather": forbidden, "all_gather_into_tensor": forbidden,
               "all_gather_single": forbidden}
    saved = {name: getattr(dist, name) for name in patched if hasattr(dist, name)}
    try:
        for name in saved:
            setattr(dist, name, patched[name])
        _check(group, k, me)
    finally:
        for name, function in saved.items():
            setattr(dist, name, function)
    assert sizes and max(sizes) <= 2 * SEQ * BATCH


def _cross_entropy_world4(rank, world_size):
    pair_group = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2]
    world_group = dist.new_group(list(range(world_size)))
    for group, k, me in ((None, 1, 0), (pair_group, 2, rank % 2), (world_group, 4, rank)):
        _check(group, k, me)
        _check(group, k, me, scale=10.0, offset=1e4, dtype=torch.float64)  # logits around 1e4
        if group is not None:
            _check_collectives_stay_small(group, k, me)


@pytest.mark.distributed
def test_matches_torch_cross_entropy_for_tp_1_2_4():
    run_distributed(_cross_entropy_world4, 4)


def test_single_rank_matches_torch():
    _check(None, 1, 0)


def test_stable_for_large_logits():
    """Around 1e4 the naive exp overflows; the max-subtracted form matches a float64 reference."""
    logits, target, _ = _inputs(scale=10.0, offset=1e4)
    assert torch.isinf(logits.exp()).any()
    _check(None, 1, 0, scale=10.0, offset=1e4, dtype=torch.float64)
    _check(None, 1, 0, scale=10.0, offset=-1e4, dtype=torch.float64)


def test_bf16_logits_give_fp32_loss_and_bf16_grad():
    logits, target, grad_loss = _inputs()
    local = logits.bfloat16().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, None)
    loss.backward(grad_loss)
    assert loss.dtype == torch.float32 and local.grad.dtype == torch.bfloat16
    loss_ref, grad_ref = _reference(logits.bfloat16().double(), target, grad_loss, torch.float64)
    assert_normwise_close(loss.detach(), loss_ref, tol=1e-6)
    assert_normwise_close(local.grad, grad_ref, tol=1e-2)


def _check_batch_first_view(device):
    """Logits [b, s, V] that are a transposed view of sequence-first ones (the pipeline's head under
    sequence parallelism) give the losses of their copy, and the gradient reaches the sequence-first
    logits contiguous: neither the logits nor their gradient is copied into the view's order."""
    logits, target, grad_loss = _inputs()
    sequence_first = logits.to(device).bfloat16().requires_grad_(True)  # [s, b, V]
    batch_first = sequence_first.transpose(0, 1)  # [b, s, V], strided
    loss = vocab_parallel_cross_entropy(batch_first, target.t().to(device), None)  # [b, s]
    copied = batch_first.detach().contiguous().requires_grad_(True)
    loss_of_copy = vocab_parallel_cross_entropy(copied, target.t().to(device), None)
    assert loss.shape == (BATCH, SEQ) and torch.equal(loss.detach(), loss_of_copy.detach())
    loss.backward(grad_loss.t().to(device))
    loss_of_copy.backward(grad_loss.t().to(device))
    assert sequence_first.grad.is_contiguous()
    assert torch.equal(sequence_first.grad.transpose(0, 1), copied.grad)


def test_batch_first_view():
    _check_batch_first_view("cpu")


def _unfused_forbidden(*args):
    raise AssertionError("the unfused cross entropy ran")


@pytest.fixture
def fused_path_only(monkeypatch):
    """The unfused autograd function raises: each call provably takes the Triton kernels."""
    monkeypatch.setattr(cross_entropy._VocabParallelCrossEntropy, "apply", _unfused_forbidden)


@pytest.mark.gpu
def test_fused_kernels_match_torch_on_the_gpu(fused_path_only):
    _check(None, 1, 0, device="cuda")
    _check(None, 1, 0, scale=10.0, offset=1e4, dtype=torch.float64, device="cuda")
    _check(None, 1, 0, scale=10.0, offset=-1e4, dtype=torch.float64, device="cuda")


@pytest.mark.gpu
def test_batch_first_view_not_copied(fused_path_only):
    """The Triton path reads rows of a 2-D view: a strided batch-first view goes to the kernels without a copy."""
    _check_batch_first_view("cuda")


def _fused_tp2_on_one_gpu(rank, world_size):
    cross_entropy._VocabParallelCrossEntropy.apply = _unfused_forbidden  # a spawned process of its own
    group = dist.new_group([0, 1])
    _check(group, 2, rank, device="cuda")
    _check(group, 2, rank, scale=10.0, offset=1e4, dtype=torch.float64, device="cuda")


@pytest.mark.gpu
def test_fused_kernels_combine_tp_slices():
    """Two gloo ranks on one GPU, each with half the vocabulary."""
    run_distributed(_fused_tp2_on_one_gpu, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_equals_unfused_at_the_1p3b_head_size(dtype):
    """[s, b, V] = [512, 4, 50304] (a padded GPT-2 vocabulary): loss within 1e-6, gradient within a rounding."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(512, 4, 50304, device="cuda", generator=generator) * 4).to(dtype)
    target = torch.randint(0, 50304, (512, 4), device="cuda", generator=generator)
    grad_loss = torch.rand(512, 4, device="cuda", generator=generator)
    results = []
    for function in (cross_entropy._FusedVocabParallelCrossEntropy, cross_entropy._VocabParallelCrossEntropy):
        leaf = logits.clone().requires_grad_(True)
        loss = function.apply(leaf, target, None)
        loss.backward(grad_loss)
        results.append((loss.detach(), leaf.grad))
    (loss, grad), (loss_ref, grad_ref) = results
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert_normwise_close(loss, loss_ref, tol=1e-6)
    assert_normwise_close(grad, grad_ref, tol=4e-3 if dtype == torch.bfloat16 else 1e-5)


def _bf16_logits_against_their_fp32_cast(device, loss_rtol=0.0, grad_rtol=0.0):
    """The loss of bf16 logits equals that of their fp32 copy, and the gradient equals the fp32
    copy's rounded to bf16: the pipeline's head hands bf16 logits over with no cast. Bit for bit
    unless given relative tolerances."""
    logits, target, grad_loss = (t.to(device) for t in _inputs())
    results = []
    for cast in (False, True):
        leaf = logits.bfloat16().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(leaf.float() if cast else leaf, target, None)
        loss.backward(grad_loss)
        results.append((loss.detach(), leaf.grad))
    (loss, grad), (loss_cast, grad_cast) = results
    torch.testing.assert_close(loss, loss_cast, rtol=loss_rtol, atol=0)
    torch.testing.assert_close(grad, grad_cast, rtol=grad_rtol, atol=0)


def test_bf16_logits_need_no_cast():
    _bf16_logits_against_their_fp32_cast("cpu")


@pytest.mark.gpu
def test_bf16_logits_need_no_cast_in_the_fused_kernels(fused_path_only):
    """Triton lays a bf16 tile out unlike an fp32 one, so the kernels' sums may add in another order
    (seen: 1 fp32 ulp of the loss on an H100): the loss agrees to fp32 rounding, the gradient to
    one bf16 rounding."""
    _bf16_logits_against_their_fp32_cast("cuda", loss_rtol=4 * torch.finfo(torch.float32).eps,
                                          grad_rtol=torch.finfo(torch.bfloat16).eps)
