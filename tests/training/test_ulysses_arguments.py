"""--ds-sequence-parallel-size: the layout and batch it implies, the combinations refused with one line
before any process group (in-process parsing; one real launch shows the line and the exit), and the
dropout streams of its ranks."""
import dataclasses

import pytest

from megatron.training.arguments import ArgumentError
from megatron.training.config import build_config
from tests.training.e2e_utils import run_pretrain, tiny_gpt_flags
from tests.training.test_arguments import error, parse, world

S2 = ["--ds-sequence-parallel-size", "2"]


def config_of(extra, processes):
    return build_config(parse(extra, env=world(processes)), tokenizer_vocab_size=1000)


def test_layout_and_batch_count_sample_streams_not_sequence_parallel_ranks():
    config = config_of(S2 + ["--tensor-model-parallel-size", "2", "--global-batch-size", "4"], 8)
    parallel = config.parallel
    assert (parallel.sequence_parallel_size, parallel.data_parallel_size, parallel.data_shard_size) == (2, 4, 2)
    assert config.schedule.global_batch_size == 4  # 2 sample streams x micro batch 2
    assert config.deepspeed.config["train_batch_size"] == 4
    config = config_of(S2 + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                             "--sequence-parallel"], 16)
    assert (config.parallel.data_parallel_size, config.parallel.data_shard_size) == (4, 2)


@pytest.mark.parametrize("extra, processes, words", [
    (S2, 3, ["world size 3 is not a multiple of", "--ds-sequence-parallel-size (2)"]),
    (["--ds-sequence-parallel-size", "0"], 1, ["--ds-sequence-parallel-size must be >= 1"]),
    (S2 + ["--reset-attention-mask"], 2, ["with --reset-attention-mask is not supported"]),
    (S2 + ["--global-batch-size", "2"], 4, ["data-parallel size 2 = world size 4 / (TP 1 x PP 1 x S 2)"]),
])
def test_refused_at_parse(extra, processes, words):
    message = error(extra, env=world(processes))
    assert all(word in message for word in words), message


@pytest.mark.parametrize("extra, processes, words", [
    (S2 + ["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "2"], 4,
     ["--num-attention-heads (6) / --tensor-model-parallel-size (2) = 3 per TP rank is not divisible by "
      "--ds-sequence-parallel-size (2)"]),
    (S2 + ["--seq-length", "31"], 2, ["--seq-length (31) is not divisible by --ds-sequence-parallel-size (2)"]),
    (S2 + ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "30"], 4,
     ["--seq-length (30) is not divisible by --ds-sequence-parallel-size (2) x --tensor-model-parallel-size (2)"]),
    (S2 + ["--group-query-attention", "--num-query-groups", "1"], 2,
     ["--num-query-groups (1) / --tensor-model-parallel-size (1) = 1 per TP rank is not divisible"]),
])
def test_refused_with_the_model_config(extra, processes, words):
    with pytest.raises(ArgumentError) as info:
        config_of(extra, processes)
    assert all(word in str(info.value) for word in words), str(info.value)


@pytest.mark.distributed
def test_a_refused_launch_prints_one_line_and_starts_no_process_group(e2e_data):
    flags = tiny_gpt_flags(e2e_data) + S2 + ["--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
                                             "--reset-attention-mask"]
    result = run_pretrain(flags, nproc=2)
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert errors == ["pretrain_gpt.py: error: --ds-sequence-parallel-size 2 with --reset-attention-mask is not "
                      "supported: run Ulysses with whole-sequence causal masks and a fixed --seq-length"]
    assert "initializing torch distributed" not in result.output and "Traceback" not in result.output


def test_sequence_parallel_ranks_draw_their_own_dropout_masks():
    import torch

    from megatron.core.parallel_state import single_rank_groups
    from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker
    from megatron.training.initialize import set_random_seeds

    def masks(sp_rank):
        groups = dataclasses.replace(single_rank_groups(), sp_rank=sp_rank, sp_size=2)
        set_random_seeds(1234, groups)
        hidden = torch.nn.functional.dropout(torch.ones(64), 0.5)
        with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
            attention = torch.nn.functional.dropout(torch.ones(64), 0.5)
        return hidden, attention

    first, second = masks(0), masks(1)
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    set_random_seeds(1234, single_rank_groups())
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), first[0])  # SP rank 0 is the S = 1 run
