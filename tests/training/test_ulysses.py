"""DeepSpeed-Ulysses end to end: pretrain_gpt.py with --ds-sequence-parallel-size 2 trains the model the
one-process run trains, and its checkpoints resume at another S.

Set-up: test_layout_equivalence's flags (fp32, dropout 0, CPU initialization, weight decay 1.0,
clipping that triggers, 6 iterations of global batch 4, sequence 64, 4 heads), so the losses agree
to 1e-5 relative and the gradient norms to 1e-4 (that file explains both). Each model runs on one
process and in a Ulysses layout of 4 processes:

    learned     learned absolute positions, --eod-mask-loss (loss masks uneven over the two halves),
                ZeRO 0, PP = 2 x S = 2; saved at iteration 2
    rope-gqa    rotary positions, 4 query heads over 2 key/value groups, ZeRO 2 (the plain engine),
                S = 2 x D = 2 (two sample streams); saved at iteration 2
    alibi       ALiBi at TP = 2 x S = 2 with --sequence-parallel (the pipeline engine at PP = 1): each
                rank's slopes are those of its heads, and each SP rank's positions split over TP

and learned again at ZeRO 3 x S = 2 (2 processes; ZeRO 3 gives ZeRO 0's losses). At TP = 1 the attention
takes the path with the exchanges beside the projections (ulysses.OVERLAP_PROJECTIONS; the ZeRO-3 run
counts its calls through ulysses_trainer.py); rope-gqa and learned at ZeRO 3 run once more with it off
(the pipelined exchange that TP = 2 takes), their calls counted too.

Resumes, compared with iterations 3-6 of the one-process run: learned's checkpoint loads as it is
at PP = 2 x S = 1 (ZeRO 0: the optimizer state sits in the model-states files, whatever the
data-parallel size); rope-gqa's ZeRO-2 partitions (S x D = 4 of them) are refused as they are at
S = 1, as for any other change of the data-parallel size, and go through the universal checkpoint
(tools/convert_checkpoint/ds_to_universal.py) to a ZeRO-1 run on one process.
"""
import os
import re
import shutil

import pytest

from megatron.core.flops import model_flops_per_iteration
from tests.training.e2e_utils import PRETRAIN_SCRIPT, read_scalars, run_pretrain, run_script
from tests.training.test_layout_equivalence import (GLOBAL_BATCH, SEQ_LENGTH, TRAIN_ITERS,
                                                    assert_counters_of_every_iteration, common_flags, series)
from tools.convert_checkpoint import ds_to_universal

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LOSS_RTOL, GRAD_NORM_RTOL, SAVE_ITERATION = 1e-5, 1e-4, 2
LOSS, GRAD_NORM, LR = "lm-loss-training/lm loss", "grad-norm/grad-norm", "learning-rate/learning-rate"
S2 = ["--ds-sequence-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
SUMMARY_SPEED = re.compile(r"tokens per second: ([\d.]+) \| model TFLOP/s per GPU: ([\d.e+-]+) \|")
ROPE_GQA = ["--position-embedding-type", "rotary", "--group-query-attention", "--num-query-groups", "2"]
MODELS = {"learned": ["--eod-mask-loss"], "rope-gqa": ROPE_GQA + ["--zero-stage", "2"],
          "alibi": ["--position-embedding-type", "alibi"]}
COUNTING_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ulysses_trainer.py")
# Ulysses run -> (the model whose one-process run it must match, processes, layout flags, whether it saves,
# the attention path every rank must take where the run counts it (ulysses_trainer.py), else None)
ULYSSES = {"learned": ("learned", 4, S2 + PP2, True, None),
           "rope-gqa": ("rope-gqa", 4, S2, True, None),
           "alibi": ("alibi", 4, S2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], False, None),
           "learned-zero3": ("learned", 2, S2 + ["--zero-stage", "3"], False, "projections"),
           "rope-gqa-pipelined": ("rope-gqa", 4, S2, False, "pipelined"),
           "learned-zero3-pipelined": ("learned", 2, S2 + ["--zero-stage", "3"], False, "pipelined")}


def train(data, directory, processes: int, flags: list[str], path: str | None = None) -> dict:
    """The run's scalars, log lines and output; with ``path``, through ulysses_trainer.py with the exchanges
    beside the projections off where ``path`` is "pipelined"."""
    tensorboard = os.path.join(directory, "tb")
    script, env = PRETRAIN_SCRIPT, None
    if path is not None:
        script, env = COUNTING_SCRIPT, {"ULYSSES_OVERLAP_PROJECTIONS": "0"} if path == "pipelined" else None
    result = run_script([script, *common_flags(data), *flags, "--tensorboard-dir", tensorboard], nproc=processes,
                        env=env)
    result.assert_ok()
    return {"scalars": read_scalars(tensorboard), "lines": result.log_lines(), "output": result.output,
            "processes": processes}


def model_flops_per_token(run: dict) -> float:
    """The model FLOPs per token the run's summary counted: model TFLOP/s per GPU x GPUs / tokens per second."""
    tokens_per_second, tflops_per_gpu = (float(value) for value in SUMMARY_SPEED.search(run["output"]).groups())
    return tflops_per_gpu * 1e12 * run["processes"] / tokens_per_second


@pytest.fixture(scope="module")
def runs(e2e_data, tmp_path_factory):
    """(model, "single") or (Ulysses run, "ulysses") -> the run's TensorBoard scalars, log lines and output, run once;
    a saving Ulysses run also gives "save", its --save directory."""
    found = {}

    def run(model, kind):
        if (model, kind) not in found:
            directory = str(tmp_path_factory.mktemp(f"{model}_{kind}"))
            if kind == "single":
                found[model, kind] = train(e2e_data, directory, 1, MODELS[model])
            else:
                reference, processes, layout, saves, path = ULYSSES[model]
                save = os.path.join(directory, "checkpoints")
                extra = ["--save", save, "--save-interval", str(SAVE_ITERATION)] if saves else []
                found[model, kind] = dict(train(e2e_data, directory, processes, MODELS[reference] + layout + extra,
                                                path), save=save)
        return found[model, kind]

    return run


@pytest.mark.parametrize("name", list(ULYSSES))
def test_ulysses_matches_the_one_process_run(runs, name):
    single, ulysses = runs(ULYSSES[name][0], "single"), runs(name, "ulysses")
    assert series(ulysses["scalars"], LOSS) == pytest.approx(series(single["scalars"], LOSS), rel=LOSS_RTOL)
    assert series(ulysses["scalars"], GRAD_NORM) == pytest.approx(series(single["scalars"], GRAD_NORM),
                                                                  rel=GRAD_NORM_RTOL)
    assert series(ulysses["scalars"], LR) == series(single["scalars"], LR)
    # whole sequences: the samples and tokens of the one-process run, and the printed loss is the whole one
    assert_counters_of_every_iteration(ulysses["lines"], name)
    assert [line.number("lm loss") for line in ulysses["lines"]] == \
        pytest.approx(series(single["scalars"], LOSS), rel=LOSS_RTOL)
    assert "initializing DeepSpeed-Ulysses sequence parallel with size 2" in ulysses["output"]
    path = ULYSSES[name][4]
    if path is not None:  # every rank's attention took that path, and only it
        counts = re.findall(r"Ulysses attention calls: projections (\d+), pipelined (\d+)", ulysses["output"])
        taken = [int(pair[path == "pipelined"]) for pair in counts]
        other = [int(pair[path != "pipelined"]) for pair in counts]
        assert len(counts) == ULYSSES[name][1] and min(taken) > 0 and max(other) == 0, counts


def test_flops_count_attention_at_the_full_length(runs):
    """The tiny model's attention term (4sp per token and layer) is 4 % of its FLOPs at s = 64: counted at
    s / 2 the figure would be 4 % lower. (The summary prints the TFLOP/s to 4 digits.)"""
    shape = dict(global_batch_size=1, num_layers=2, hidden_size=64, padded_vocab_size=1152)
    whole = model_flops_per_iteration(seq_length=SEQ_LENGTH, **shape) / SEQ_LENGTH
    half = model_flops_per_iteration(seq_length=SEQ_LENGTH // 2, **shape) / (SEQ_LENGTH // 2)
    assert whole / half > 1.03
    assert model_flops_per_token(runs("learned", "ulysses")) == pytest.approx(whole, rel=2e-3)
    assert model_flops_per_token(runs("learned", "single")) == pytest.approx(whole, rel=2e-3)


def test_the_pairs_differ(runs):
    """Guard against a vacuous comparison: positions and masks change the losses."""
    last = [round(series(runs(model, "single")["scalars"], LOSS)[-1], 5) for model in MODELS]
    assert len(set(last)) == len(MODELS)


def checkpoint_at(save: str, destination: str) -> str:
    """A --load directory holding only the iteration-2 checkpoint of ``save``."""
    os.makedirs(destination)
    shutil.copytree(os.path.join(save, f"global_step{SAVE_ITERATION}"),
                    os.path.join(destination, f"global_step{SAVE_ITERATION}"))
    with open(os.path.join(destination, "latest"), "w") as latest:
        latest.write(f"global_step{SAVE_ITERATION}")
    return destination


def assert_continues(resumed: dict, single: dict):
    resumed_steps = range(SAVE_ITERATION + 1, TRAIN_ITERS + 1)
    expected = series(single["scalars"], LOSS)[SAVE_ITERATION:]
    assert series(resumed["scalars"], LOSS, resumed_steps) == pytest.approx(expected, rel=LOSS_RTOL)
    assert series(resumed["scalars"], LR, resumed_steps) == series(single["scalars"], LR)[SAVE_ITERATION:]
    assert [int(line.number("consumed samples")) for line in resumed["lines"]] == \
        [GLOBAL_BATCH * i for i in resumed_steps]
    assert [int(line.number("consumed tokens")) for line in resumed["lines"]] == \
        [GLOBAL_BATCH * SEQ_LENGTH * i for i in resumed_steps]


def test_a_zero0_checkpoint_of_s2_resumes_at_s1(runs, e2e_data, tmp_path):
    load = checkpoint_at(runs("learned", "ulysses")["save"], str(tmp_path / "load"))
    resumed = train(e2e_data, str(tmp_path), 2, MODELS["learned"] + PP2 + ["--load", load])
    assert f"successfully loaded checkpoint from {load} at iteration {SAVE_ITERATION}" in resumed["output"]
    assert_continues(resumed, runs("learned", "single"))


def test_zero_partitions_of_s2_go_through_the_universal_checkpoint_to_s1(runs, e2e_data, tmp_path, capsys):
    load = checkpoint_at(runs("rope-gqa", "ulysses")["save"], str(tmp_path / "load"))
    refused = run_pretrain(common_flags(e2e_data) + MODELS["rope-gqa"] + ["--load", load], nproc=1)
    assert refused.returncode == 1 and "Traceback" not in refused.output
    assert "was saved with data-parallel size 4 and ZeRO-partitioned optimizer states; this run has data-parallel " \
           "size 1" in refused.output
    model = ROPE_GQA + ["--zero-stage", "1"]
    universal = str(tmp_path / "universal")
    os.makedirs(universal)
    status = ds_to_universal.main(["--input_folder", os.path.join(load, f"global_step{SAVE_ITERATION}"),
                                   "--output_folder", os.path.join(universal, f"global_step{SAVE_ITERATION}_universal"),
                                   "--num_extract_workers", "1", "--num_merge_workers", "1"])
    assert status == 0 and f"universal checkpoint of iteration {SAVE_ITERATION}" in capsys.readouterr().out
    resumed = train(e2e_data, str(tmp_path), 1, model + ["--load", universal, "--universal-checkpoint"])
    assert f"successfully loaded checkpoint from {universal} at iteration {SAVE_ITERATION}" in resumed["output"]
    assert_continues(resumed, runs("rope-gqa", "single"))
