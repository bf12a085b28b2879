"""Sequence-length curriculum learning: the schedules against hand tables, the ds_config checks, the batch
cut, evaluation at the full length, and real pretrain_gpt.py runs (lengths, tokens, learning rates and the
--train-tokens stop against a hand table; a resumed run equal to the uninterrupted one; TP=2 x PP=2 and
the plain ZeRO-2 engine equal to TP=1).
"""
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.config import build_config
from megatron.training.curriculum import CurriculumConfig
from megatron.training.engine.curriculum_scheduler import SequenceLengthCurriculum
from megatron.training.data_loading import get_batch, truncate_batch
from megatron.training.training import Trainer
from tests.dist_utils import free_port
from tests.training.e2e_utils import EXAMPLES_DIR, executable, read_scalars, run_command, run_pretrain, tiny_gpt_flags

# ---------------------------------------------------------------------------------------------------------
# The schedules, L(t) for iteration t, computed by hand:
#   fixed_linear  min 16, max 64, T 8, d 8: floor(t/8 * 48 + 16) down to a multiple of 8
#       t=1: 22 -> 16   t=2: 28 -> 24   t=3: 34 -> 32   t=4: 40   t=5: 46 -> 40   t=6: 52 -> 48
#       t=7: 58 -> 56   t=8: 64         t=9: 64 (stays at max)
#   fixed_root    min 8, max 64, T 16, d 8, degree 2: floor(sqrt(t/16) * 56 + 8) down to a multiple of 8
#       t=1: 0.25*56+8 = 22 -> 16      t=2: 0.35355*56+8 = 27.8 -> 24   t=3: 0.43301*56+8 = 32.2 -> 32
#       t=5: 0.55902*56+8 = 39.3 -> 32  t=9: 0.75*56+8 = 50 -> 48       t=16: 64   t=20: 64
#   fixed_discrete difficulty [16, 32, 64], max_step [2, 4]: t <= 2 -> 16, t <= 4 -> 32, then 64
# ---------------------------------------------------------------------------------------------------------
SCHEDULES = {
    "fixed_linear": ({"total_curriculum_step": 8, "difficulty_step": 8}, 16,
                     {1: 16, 2: 24, 3: 32, 4: 40, 5: 40, 6: 48, 7: 56, 8: 64, 9: 64}),
    "fixed_root": ({"total_curriculum_step": 16, "difficulty_step": 8, "root_degree": 2}, 8,
                   {1: 16, 2: 24, 3: 32, 5: 32, 9: 48, 16: 64, 20: 64}),
    "fixed_discrete": ({"difficulty": [16, 32, 64], "max_step": [2, 4]}, 16,
                       {1: 16, 2: 16, 3: 32, 4: 32, 5: 64, 50: 64}),
}


@pytest.mark.parametrize("schedule_type", SCHEDULES)
def test_each_schedule_follows_its_hand_table(schedule_type):
    schedule_config, minimum, table = SCHEDULES[schedule_type]
    curriculum = SequenceLengthCurriculum(CurriculumConfig(minimum, 64, schedule_type, schedule_config))
    assert {t: curriculum.length_for(t) for t in table} == table


def test_restored_length_continues_the_schedule():
    """Once the maximum is reached it stays (DeepSpeed's rule), even where the discrete table goes lower:
    a resumed run must know where it was, not recompute from the step."""
    config = CurriculumConfig(16, 64, "fixed_discrete", {"difficulty": [16, 64, 32, 64], "max_step": [1, 2, 3]})
    uninterrupted = SequenceLengthCurriculum(config)
    assert [uninterrupted.length_for(t) for t in (1, 2, 3)] == [16, 64, 64]
    resumed = SequenceLengthCurriculum(config)
    resumed.restore(uninterrupted.current)
    assert resumed.length_for(3) == 64
    assert SequenceLengthCurriculum(config).length_for(3) == 32  # what forgetting the state would give


# ---------------------------------------------------------------------------------------------------------
# The ds_config checks
# ---------------------------------------------------------------------------------------------------------
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
         "--seq-length", "64", "--max-position-embeddings", "64", "--train-samples", "1000", "--lr", "1e-3",
         "--data-path", "/data/corpus_text_document", "--vocab-file", "vocab.json", "--merge-file", "merges.txt"]
BLOCK = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 16, "max_difficulty": 64,
         "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 8}}


def parse_with_block(tmp_path, block, *extra):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"curriculum_learning": block}))
    return parse_args(FLAGS + ["--deepspeed", "--deepspeed_config", str(path), *extra], env={}, cuda_available=False)


def test_a_valid_block_reaches_the_schedule_config_but_not_deepspeed(tmp_path):
    config = build_config(parse_with_block(tmp_path, BLOCK, "--lr-decay-tokens", "64000"), tokenizer_vocab_size=1000)
    assert config.schedule.curriculum == CurriculumConfig(16, 64, "fixed_linear", BLOCK["schedule_config"])
    assert "curriculum_learning" in config.deepspeed.config
    assert "curriculum_learning" not in config.deepspeed.config_for_initialize()


@pytest.mark.parametrize("change, extra, words", [
    ({"min_difficulty": 12}, ["--lr-decay-tokens", "64000"], ["min_difficulty", "12", "multiple of 8"]),
    ({"max_difficulty": 128}, ["--lr-decay-tokens", "64000"], ["max_difficulty", "128", "--seq-length is 64"]),
    ({}, [], ["--lr-decay-tokens", "token-based"]),
    ({"curriculum_type": "vocabularysize"}, ["--lr-decay-tokens", "64000"], ["curriculum_type", "seqlen"]),
    ({"schedule_type": "fixed_square"}, ["--lr-decay-tokens", "64000"], ["schedule_type", "fixed_linear"]),
    ({"schedule_config": {"total_curriculum_step": 8, "difficulty_step": 4}}, ["--lr-decay-tokens", "64000"],
     ["difficulty_step", "multiple of 8"]),
    ({"schedule_type": "fixed_root"}, ["--lr-decay-tokens", "64000"], ["root_degree"]),
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [16, 32], "max_step": [4]}},
     ["--lr-decay-tokens", "64000"], ["difficulty", "end at --seq-length 64"]),
])
def test_bad_blocks_are_refused_naming_the_key(tmp_path, change, extra, words):
    with pytest.raises(ArgumentError) as info:
        parse_with_block(tmp_path, {**BLOCK, **change}, *extra)
    for word in words:
        assert word in str(info.value)


def test_a_constant_learning_rate_needs_no_token_decay(tmp_path):
    assert parse_with_block(tmp_path, BLOCK, "--lr-decay-style", "constant").flags.deepspeed


# ---------------------------------------------------------------------------------------------------------
# The batch cut and the length during evaluation
# ---------------------------------------------------------------------------------------------------------
def test_a_cut_batch_equals_the_batch_of_the_shorter_text():
    """With EOD resets of positions and attention, the first L positions of the batch are the batch of
    the first L + 1 tokens: the cut loses nothing the model would see."""
    eod = 0
    text = torch.randint(1, 50, (3, 33))
    text[:, [5, 17, 30]] = eod
    flags = SimpleNamespace(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    full = get_batch({"text": text}, eod, flags, torch.device("cpu"))
    cut = truncate_batch(full, 16)
    short = get_batch({"text": text[:, :17]}, eod, flags, torch.device("cpu"))
    for name in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
        assert torch.equal(getattr(cut, name), getattr(short, name)), name
    assert truncate_batch(full, 32) is full


def test_evaluation_runs_at_the_full_length_and_gives_the_curriculum_length_back():
    """Trainer.evaluate on a stand-in engine: every evaluation step sees --seq-length, the engine is
    told of the length on the way in and out, and training resumes at the curriculum's length."""
    trainer = Trainer.__new__(Trainer)
    trainer.config = SimpleNamespace(model=SimpleNamespace(seq_length=64))
    trainer.schedule = SimpleNamespace(eval_iters=3)
    trainer.active_seq_length = 24
    trainer.fp8_steps = None
    resets, lengths_seen = [], []
    trainer.engine = SimpleNamespace(sequence_length_changed=lambda: resets.append(trainer.active_seq_length))
    trainer._eval_step = lambda iterator: lengths_seen.append(trainer.active_seq_length) or 2.0
    assert trainer.evaluate(iterator=None) == 2.0
    assert lengths_seen == [64, 64, 64] and resets == [64, 24] and trainer.active_seq_length == 24


# ---------------------------------------------------------------------------------------------------------
# Real runs: micro batch 2, global batch 4, --seq-length 64, the fixed_linear table above (16, 24, 32, 40,
# 40, 48 for iterations 1-6), --train-samples 100 (25 iterations) but --train-tokens 700:
#   tokens per iteration 4·L: 64, 96, 128, 160, 160, 192 -> consumed 64, 160, 288, 448, 608, 800: the run
#   stops after iteration 6 (608 < 700 <= 800).
# Learning rate: --lr 1e-3 --min-lr 1e-4, --lr-warmup-tokens 150, --lr-decay-tokens 1000, linear. At step k
# the schedule sees the tokens consumed BEFORE iteration k (Megatron-DeepSpeed's lag): t = 0, 64, 160, 288,
# 448, 608. Warmup while t <= 150: 1e-3·t/150; after it r = (t - 150)/(1000 - 150), lr = 1e-4 + (1 - r)·9e-4:
#   k=1: 0   k=2: 1e-3·64/150 = 4.267e-4   k=3: r = 10/850 -> 9.894e-4   k=4: r = 138/850 -> 8.539e-4
#   k=5: r = 298/850 -> 6.845e-4   k=6: r = 458/850 -> 5.151e-4
# ---------------------------------------------------------------------------------------------------------
LENGTHS = (16, 24, 32, 40, 40, 48)
CONSUMED_TOKENS = (64, 160, 288, 448, 608, 800)
LEARNING_RATES = ("0.000E+00", "4.267E-04", "9.894E-04", "8.539E-04", "6.845E-04", "5.151E-04")
LAYOUT_RTOL = 1e-5  # fp32 sums reordered over TP and PP (see test_layout_equivalence.py)


def curriculum_flags(data, tmp_path):
    path = tmp_path / "ds_config_curriculum.json"
    path.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                "curriculum_learning": BLOCK}))
    return tiny_gpt_flags(data, split="90,10,0") + [
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-samples", "100", "--train-tokens", "700",
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-tokens", "150", "--lr-decay-tokens", "1000",
        "--lr-decay-style", "linear", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--use-cpu-initialization", "--pad-vocab-size-to",
        "1152", "--seed", "1234", "--deepspeed", "--deepspeed_config", str(path)]


@pytest.fixture(scope="module")
def runs(e2e_data, tmp_path_factory):
    """The uninterrupted TP=1 run (with TensorBoard), the same run stopped at iteration 3 and resumed,
    the TP=2 x PP=2 run and a ZeRO-2 run (the plain engine, which cuts its micro batches itself)."""
    tmp_path = tmp_path_factory.mktemp("curriculum")
    flags = curriculum_flags(e2e_data, tmp_path)
    checkpoints = str(tmp_path / "checkpoints")
    save = ["--save", checkpoints, "--save-interval", "3"]
    results = {
        "uninterrupted": run_pretrain(flags + ["--tensorboard-dir", str(tmp_path / "tb")]),
        "first half": run_pretrain(flags + save + ["--exit-interval", "3"]),
    }
    results["second half"] = run_pretrain(flags + save + ["--load", checkpoints])
    results["tp2-pp2"] = run_pretrain(flags + ["--tensor-model-parallel-size", "2",
                                               "--pipeline-model-parallel-size", "2"], nproc=4)
    results["zero2"] = run_pretrain(flags + ["--zero-stage", "2"])  # the plain engine: GPTModel
    for result in results.values():
        result.assert_ok()
    return results, str(tmp_path / "tb")


@pytest.mark.slow
@pytest.mark.distributed
def test_lengths_tokens_learning_rates_and_the_token_stop_follow_the_hand_table(runs):
    results, tensorboard_dir = runs
    lines = results["uninterrupted"].log_lines()
    assert [(line.iteration, line.train_iters) for line in lines] == [(i, 25) for i in range(1, 7)]
    assert tuple(int(line.number("curriculum seqlen")) for line in lines) == LENGTHS
    assert tuple(int(line.number("consumed tokens")) for line in lines) == CONSUMED_TOKENS
    assert tuple(line.fields["learning rate"] for line in lines) == LEARNING_RATES
    scalars = read_scalars(tensorboard_dir)
    assert scalars["curriculum_seqlen"] == [(i, float(length)) for i, length in enumerate(LENGTHS, 1)]
    assert [step for step, _ in scalars["lm-loss-training/lm loss vs tokens"]] == list(CONSUMED_TOKENS)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_resumed_run_continues_the_schedule_and_the_losses(runs):
    results, _ = runs
    uninterrupted = results["uninterrupted"].log_lines()
    first, second = results["first half"].log_lines(), results["second half"].log_lines()
    assert [line.iteration for line in first + second] == list(range(1, 7))
    for field in ("curriculum seqlen", "consumed tokens", "learning rate", "lm loss", "grad norm"):
        assert [line.fields[field] for line in first + second] == [line.fields[field] for line in uninterrupted]
    validation = results["uninterrupted"].validation_losses()
    assert len(validation) == 3  # iterations 3 and 6, and the end of training
    assert results["first half"].validation_losses() + results["second half"].validation_losses() == validation


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2-pp2", "zero2"])
def test_other_layouts_train_the_same_curriculum_as_tp1(runs, layout):
    results, _ = runs
    single, other = results["uninterrupted"].log_lines(), results[layout].log_lines()
    for field in ("curriculum seqlen", "consumed tokens", "learning rate"):
        assert [line.fields[field] for line in other] == [line.fields[field] for line in single]
    assert [line.number("lm loss") for line in other] == \
        pytest.approx([line.number("lm loss") for line in single], rel=LAYOUT_RTOL)
    assert [loss for _, loss, _ in results[layout].validation_losses()] == \
        pytest.approx([loss for _, loss, _ in results["uninterrupted"].validation_losses()], rel=LAYOUT_RTOL)


# ---------------------------------------------------------------------------------------------------------
# examples/pretrain_gpt_104b_curriculum.sh through the deepspeed launcher (2 CPU processes): L(t) =
# min(256, 64 + 16 t), global batch 8, so consumed tokens 640, 1408, 2304, ..., 16128 after iteration 12
# (8 · sum of 64 + 16 t), then + 2048 per iteration: 18176, 20224 >= --train-tokens 20_000 stops it at 14
# of the 50 iterations --train-samples 400 allows.
# ---------------------------------------------------------------------------------------------------------
RECIPE_LENGTHS = tuple(64 + 16 * t for t in range(1, 13)) + (256, 256)
RECIPE_TOKENS = tuple(8 * sum(RECIPE_LENGTHS[:t]) for t in range(1, 15))


@pytest.mark.slow
@pytest.mark.distributed
def test_the_104b_curriculum_recipe_runs_through_the_deepspeed_launcher(e2e_data, tmp_path):
    env = {"DATA_PATH": e2e_data.data_prefix, "VOCAB_FILE": e2e_data.vocab_file, "MERGE_FILE": e2e_data.merge_file,
           "OUTPUT_DIR": str(tmp_path), "MASTER_PORT": str(free_port()), "N_GPUS": "2",
           "PATH": os.pathsep.join([os.path.dirname(executable("deepspeed")), os.environ["PATH"]])}
    result = run_command(["bash", os.path.join(EXAMPLES_DIR, "pretrain_gpt_104b_curriculum.sh")], env=env,
                         timeout=400)
    result.assert_ok()
    lines = result.log_lines()
    assert "world size 2 (launcher: deepspeed)" in result.output
    assert [(line.iteration, line.train_iters) for line in lines] == [(i, 50) for i in range(1, 15)]
    assert tuple(int(line.number("curriculum seqlen")) for line in lines) == RECIPE_LENGTHS
    assert tuple(int(line.number("consumed tokens")) for line in lines) == RECIPE_TOKENS
    assert all(math.isfinite(line.number("lm loss")) for line in lines)
    assert "successfully saved checkpoint at iteration      14" in result.output
    assert read_scalars(str(tmp_path / "tensorboard"))["curriculum_seqlen"][-1] == (14, 256.0)
