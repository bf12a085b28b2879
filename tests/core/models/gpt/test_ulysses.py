"""DeepSpeed-Ulysses (ParallelGroups.sp) in GPTModel against the one-process model, on 4 gloo ranks.

Layouts: S = 2 with two sample streams (TP = 1, D = 2; also with the exchange in two chunks, which the
tiny models' few heads otherwise never take, and with the exchanges beside the projections), and S = 2 x TP = 2 (also with --sequence-parallel, which
splits each SP rank's positions over the TP ranks). Every SP rank feeds its
slice of the positions (tokens, labels, loss mask, position ids keep their global values); the loss
each returns is S x its slice's share of the whole sequence's masked mean (gpt_model.sequence_slice_token_mean),
so the mean over the SP group is the reference loss and the mean of the gradients (what the engine's
data-parallel average computes) is the reference gradient. The loss mask drops the tokens after each
EOD, which fall unevenly on the two halves, so a per-slice normalisation would show.
"""
import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt import ulysses
from megatron.core.models.gpt.masks import get_ltor_masks_and_position_ids
from megatron.core.models.gpt.ulysses import chunk_count, pipelined_attention
from megatron.core.parallel_state import initialize_model_parallel
from tests.core.models.gpt.gpt_test_utils import (copy_full_weights, full_grads, random_tokens, randomize_parameters,
                                                  relative_error, tiny_config)
from tests.core.models.gpt.test_gpt_model import LLAMA, build
from tests.dist_utils import run_distributed

EOD, SEQ_LENGTH = 0, 16
CONFIGS = [
    dict(),
    dict(position_embedding_type="rotary", checkpoint_activations=True),
    dict(position_embedding_type="alibi", attention_impl="materialized"),
    dict(position_embedding_type="alibi"),
    dict(LLAMA),  # 8 heads over 4 key/value groups: grouped-query attention
    dict(position_embedding_type="rotary", sequence_parallel=True),  # and Megatron's split over TP (at TP = 2)
]


def _batch():
    tokens = random_tokens(2, SEQ_LENGTH + 1, 64, seed=13)
    tokens[0, 3] = tokens[1, 6] = EOD
    masks = get_ltor_masks_and_position_ids(tokens[:, :-1], EOD, eod_mask_loss=True)
    return tokens, masks


def _check_parity(config, groups):
    reference = build(config, seed=12)
    model = GPTModel(config, groups)
    copy_full_weights(model, {n: p.detach() for n, p in reference.named_parameters()}, groups.tp_rank,
                      groups.tp_size)
    tokens, masks = _batch()
    expected = reference(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=masks.loss_mask)
    expected.backward()
    block = SEQ_LENGTH // groups.sp_size
    mine = slice(groups.sp_rank * block, (groups.sp_rank + 1) * block)
    loss = model(tokens[:, :-1][:, mine], position_ids=masks.position_ids[:, mine], labels=tokens[:, 1:][:, mine],
                 loss_mask=masks.loss_mask[:, mine])
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=groups.sp)
    assert relative_error(mean_loss / groups.sp_size, expected.detach()) <= 1e-5, config
    grads = full_grads(model.named_parameters(), groups.tp)
    for name, param in reference.named_parameters():
        dist.all_reduce(grads[name], group=groups.sp)
        error = relative_error(grads[name] / groups.sp_size, param.grad)
        assert error <= 1e-5, f"tp={groups.tp_size} sp={groups.sp_size} {name}: gradient error {error:.2e}"


def _ulysses_worker(rank, world_size):
    default = ulysses.MIN_HEADS_PER_CALL
    # 1 head per call: the tiny models' exchange in several chunks; overlap: beside the projections (TP = 1)
    for tp, min_heads_per_call, overlap in ((1, default, False), (1, 1, False), (1, default, True), (2, default, False)):
        ulysses.MIN_HEADS_PER_CALL, ulysses.OVERLAP_PROJECTIONS = min_heads_per_call, overlap
        groups = initialize_model_parallel(tensor_model_parallel_size=tp, sequence_parallel_size=2)
        assert groups.sp_size == 2 and groups.data_shard_size == 2 // tp
        for overrides in CONFIGS:
            config = tiny_config(seq_length=SEQ_LENGTH, **overrides)
            randomize_parameters(torch.nn.Linear(1, 1), seed=0)  # the same default RNG state on every rank
            _check_parity(config, groups)


@pytest.mark.distributed
def test_ulysses_matches_the_one_process_model():
    run_distributed(_ulysses_worker, 4)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_attention_heads=6, hidden_size=48, tensor_model_parallel_size=2), "3 per TP rank is not divisible by "
                                                                "--ds-sequence-parallel-size"),
    (dict(LLAMA, num_query_groups=2, tensor_model_parallel_size=2), "--num-query-groups (2) / "
                                                                   "--tensor-model-parallel-size (2) = 1 per TP rank"),
    (dict(seq_length=15), "--seq-length (15) is not divisible by --ds-sequence-parallel-size (2)"),
    (dict(sequence_parallel=True, seq_length=18, max_position_embeddings=18, tensor_model_parallel_size=2),
     "--seq-length (18) is not divisible by --ds-sequence-parallel-size (2) x --tensor-model-parallel-size (2)"),
])
def test_splits_ulysses_cannot_make_are_refused(overrides, message):
    overrides = dict(overrides)
    tp = overrides.pop("tensor_model_parallel_size", 1)
    config = tiny_config(**overrides)
    with pytest.raises(ValueError) as info:
        config.validate_for_ulysses(tp, 2)
    assert message in str(info.value)
    config.validate_for_ulysses(tp, 1)


def _pipeline_worker(rank, world_size, exchange="nccl"):
    """pipelined_attention with a stand-in attention: share group g's block of the whole sequence maps to
    (g + 1) cumsum_s(block), so each rank must receive the whole sequence of exactly its groups. On the
    GPU with ``exchange`` "peer" the all-to-alls go through peer memory (ulysses.EXCHANGE)."""
    groups, batch, width, seq = 8, 2, 3, 8  # G = 8 groups of width w = 3 on this TP rank
    group = dist.new_group(list(range(world_size)))
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    ulysses.EXCHANGE = exchange
    generator = torch.Generator().manual_seed(5)
    mixed_full, weights = (torch.randn(seq, batch, groups * width, generator=generator, dtype=torch.float64).to(device)
                           for _ in range(2))
    bias_full = torch.randn(groups * width, generator=generator, dtype=torch.float64).to(device)

    def reference(mixed):
        blocks = mixed.unflatten(-1, (groups, width)).cumsum(0)
        return (blocks * torch.arange(1, groups + 1, dtype=mixed.dtype, device=device)[:, None]).flatten(-2)

    leaf = mixed_full.clone().requires_grad_()
    (reference(leaf + bias_full) * weights).sum().backward()
    mine = slice(rank * seq // world_size, (rank + 1) * seq // world_size)
    for chunks in (1, 2, 4):
        share = groups // (chunks * world_size)

        def attend_share(recv, chunk):
            first_group = chunk * share * world_size + rank * share
            factors = torch.arange(first_group + 1, first_group + share + 1, dtype=recv.dtype, device=device)
            return (recv.unflatten(-1, (share, width)).cumsum(0) * factors[:, None]).flatten(-2)

        bias = bias_full.clone().requires_grad_()
        mixed = (mixed_full[mine] + bias.detach()).requires_grad_()  # the bias already added, as in the model
        output = pipelined_attention(mixed, bias, attend_share, group, chunks)
        assert torch.allclose(output, reference(mixed_full + bias_full)[mine]), chunks
        (output * weights[mine]).sum().backward()
        assert torch.allclose(mixed.grad, leaf.grad[mine]), chunks
        bias_grad = bias.grad.clone()
        dist.all_reduce(bias_grad)  # each rank's is the sum over its positions
        assert torch.allclose(bias_grad, leaf.grad.sum(dim=(0, 1))), chunks
        with torch.no_grad():
            assert torch.equal(pipelined_attention(mixed, bias, attend_share, group, chunks), output.detach())


@pytest.mark.distributed
def test_the_pipelined_exchange_sends_each_rank_its_groups_whole():
    run_distributed(_pipeline_worker, 2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("exchange", ["nccl", "peer"])
def test_the_pipelined_exchange_on_two_gpus(exchange):
    run_distributed(_pipeline_worker, 2, exchange, backend="nccl")


@pytest.mark.parametrize("groups, size, queries, chunks", [
    (16, 2, 1, 1),  # the 1.3B at S = 2: 8 heads per rank, one call
    (32, 2, 1, 2), (64, 2, 1, 4), (128, 2, 1, 4),  # wider models: calls of 8, 8 and 16 heads
    (48, 2, 1, 3), (28, 2, 1, 1),  # 24 heads: 3 calls of 8; 14 heads: 7 does not split into calls of 8 or more
    (8, 2, 4, 2), (8, 4, 4, 1),  # grouped queries: 4 groups of 4 heads per rank, 2 calls of 8; 2 groups, 1 call
    (4, 4, 1, 1),
])
def test_the_chunk_count_keeps_calls_of_eight_heads_and_splits_every_share_evenly(groups, size, queries, chunks):
    assert chunk_count(groups, size, queries) == chunks
