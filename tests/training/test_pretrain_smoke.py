"""pretrain_gpt.py end to end on CPU: log lines, evaluation, checkpoints, TensorBoard, exits (the parallel
layouts against one process: test_layout_equivalence.py)."""
import glob
import json
import math
import os
import subprocess
import sys
import time
import zlib

import pytest
import torch

from tests.training.pretrain_helpers import (PRETRAIN, run_pretrain, tiny_run_args,
                                             training_lines, validation_lines)
from tests.dist_utils import free_port
from tests.conftest import REPO_ROOT

GLOBAL_BATCH = 4
SEQ_LENGTH = 64


@pytest.fixture(scope="module")
def fp32_run(preprocessed_corpus, tmp_path_factory):
    """4 iterations, evaluation and a checkpoint every 2, TensorBoard with every optional tag family."""
    out = tmp_path_factory.mktemp("fp32_run")
    args = tiny_run_args(preprocessed_corpus, "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", "4",
                         "--eval-interval", "2", "--eval-iters", "2", "--save", str(out / "ckpt"),
                         "--save-interval", "2", "--tensorboard-dir", str(out / "tb"), "--log-timers-to-tensorboard",
                         "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                         "--log-params-norm", "--lr-warmup-iters", "1")
    return run_pretrain(args).stdout, out


def test_log_lines_carry_real_counts(fp32_run):
    output, _ = fp32_run
    lines = training_lines(output)
    assert [line["iteration"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        i = line["iteration"]
        assert line["train_iters"] == 4
        assert line["consumed samples"] == i * GLOBAL_BATCH
        assert line["consumed tokens"] == i * GLOBAL_BATCH * SEQ_LENGTH
        assert line["global batch size"] == GLOBAL_BATCH
        assert line["number of skipped iterations"] == 0 and line["number of nan iterations"] == 0
        assert 0 < line["lm loss"] < 20 and line["grad norm"] > 0 and line["params norm"] > 0
        assert math.isclose(line["samples per second"], GLOBAL_BATCH / line["elapsed time per iteration (s)"],
                            rel_tol=0.2)
        assert "loss scale" not in line  # fp32: no loss scaling
    # warmup of 1 iteration (4 samples) then linear decay to 0 over 16 samples
    expected_lr = [1e-3, 1e-3 * 8 / 12, 1e-3 * 4 / 12, 0.0]
    assert [line["learning rate"] for line in lines] == pytest.approx(expected_lr, abs=1e-6)
    keys = list(lines[0])
    assert keys[:8] == ["iteration", "train_iters", "consumed samples", "consumed tokens",
                        "elapsed time per iteration (s)", "learning rate", "global batch size", "lm loss"]


def test_validation_and_test_lines(fp32_run):
    output, _ = fp32_run
    found = validation_lines(output)
    assert [(label, prefix) for label, prefix, _, _ in found] == [
        ("validation", "iteration 2"), ("validation", "iteration 4"),
        ("validation", "the end of training for val data"), ("validation", "the end of training for test data")]
    for _, _, loss, ppl in found:
        assert ppl == pytest.approx(math.exp(loss), rel=1e-5)


def test_milestone_lines(fp32_run):
    output, _ = fp32_run
    for text in ("time to initialize megatron (seconds):", "[after megatron is initialized] datetime:",
                 "estimated model parameters:", "[000-000] ", "setting training iterations to 4",
                 "> building train, validation, and test datasets", "[after dataloaders are built] datetime:",
                 "[Rank 0] (after 1 iterations) memory (MB) |",
                 "saving checkpoint at iteration       2 to", "successfully saved checkpoint at iteration       4"):
        assert text in output, text


def test_checkpoint_layout_and_client_state(fp32_run):
    _, out = fp32_run
    ckpt = out / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    files = sorted(os.listdir(ckpt / "global_step4"))
    # GPTModelPipe numbering: 1 embedding, 3-4 layers, 6 final norm (the tied head is not saved again)
    written = ["layer_01-model_00-model_states.pt", "layer_03-model_00-model_states.pt",
               "layer_04-model_00-model_states.pt", "layer_06-model_00-model_states.pt", "mp_rank_00_model_states.pt"]
    assert files == sorted(written + ["manifest.json"])
    manifest = json.loads((ckpt / "global_step4" / "manifest.json").read_text())
    assert (manifest["tag"], manifest["iteration"], sorted(manifest["files"])) == ("global_step4", 4, written)
    for name, entry in manifest["files"].items():
        data = (ckpt / "global_step4" / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    state = torch.load(ckpt / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["iteration"] == 2 and state["global_steps"] == 2
    assert state["consumed_train_samples"] == 2 * GLOBAL_BATCH
    assert state["consumed_train_tokens"] == state["tokens"] == 2 * GLOBAL_BATCH * SEQ_LENGTH
    assert state["consumed_valid_samples"] == 2 * GLOBAL_BATCH  # one evaluation of 2 global batches
    assert state["checkpoint_version"] == 3.0
    assert state["checkpoint_info"] == {"padded_vocab_size": 4096, "original_vocab_size": 4096}
    assert state["lr_scheduler"]["num_steps"] == 2 * GLOBAL_BATCH
    assert state["args"]["model"]["hidden_size"] == 64
    for key in ("random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"):
        assert key in state


def test_tensorboard_tags(fp32_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = fp32_run
    assert len(glob.glob(str(out / "tb" / "events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("lm-loss-training/lm loss", "lm-loss-training/lm loss vs samples", "lm-loss-training/lm loss vs tokens",
                "learning-rate/learning-rate", "batch-size/batch-size", "grad-norm/grad-norm",
                "params-norm/params-norm", "iteration-time/iteration-time", "iteration-time/samples per second",
                "iteration-time/TFLOPs per gpu (estimated)", "lm-loss-validation/lm loss validation",
                "lm-loss-validation/lm loss validation ppl", "steps-vs-tokens/y=tokens,x=steps",
                "time/train-step-time"):
        assert tag in tags, tag
    loss_vs_tokens = events.Scalars("lm-loss-training/lm loss vs tokens")
    assert [e.step for e in loss_vs_tokens] == [i * GLOBAL_BATCH * SEQ_LENGTH for i in (1, 2, 3, 4)]
    assert [e.step for e in events.Scalars("lm-loss-validation/lm loss validation")][:2] == [2, 4]


def test_bf16_run_with_a_bf16_ds_config(preprocessed_corpus, tmp_path):
    """bf16 from a ds_config at stage 0 runs DeepSpeed's BF16_Optimizer (stage 1) and saves its state;
    its gradients, added to the fp32 accumulators as backward makes them (our default), give the
    losses and norms of adding them after each micro-batch's backward bit for bit."""
    outputs = {}
    for immediate in ("true", "false"):
        ds_config = tmp_path / f"ds_config_{immediate}.json"
        ds_config.write_text('{"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4, "gradient_clipping": 1.0,'
                             ' "zero_optimization": {"stage": 0},'
                             f' "bf16": {{"enabled": true, "immediate_grad_update": {immediate}}}}}')
        args = tiny_run_args(preprocessed_corpus, "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1",
                             "--bf16", "--deepspeed", "--deepspeed_config", str(ds_config),
                             "--save", str(tmp_path / f"ckpt_{immediate}"), "--save-interval", "3")
        outputs[immediate] = run_pretrain(args).stdout
    output = outputs["true"]
    assert "grad_accum_dtype" in output  # the notice: bf16 accumulates gradients in fp32
    lines = training_lines(output)
    assert [line["iteration"] for line in lines] == [1, 2, 3]
    assert all(math.isfinite(line["lm loss"]) and line["grad norm"] > 0 for line in lines)
    assert [(line["lm loss"], line["grad norm"]) for line in lines] == \
        [(line["lm loss"], line["grad norm"]) for line in training_lines(outputs["false"])]
    files = os.listdir(tmp_path / "ckpt_true" / "global_step3")
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in files


def test_kill_switch_at_start(preprocessed_corpus, tmp_path):
    switch = tmp_path / "stop"
    switch.write_text("")
    args = tiny_run_args(preprocessed_corpus, "--train-iters", "3", "--kill-switch-path", str(switch))
    output = run_pretrain(args).stdout
    assert f"Detected kill switch at {switch}. Exiting" in output
    assert training_lines(output) == []


def test_exit_interval_saves_and_stops(preprocessed_corpus, tmp_path):
    args = tiny_run_args(preprocessed_corpus, "--train-iters", "6", "--exit-interval", "2", "--eval-iters", "0",
                         "--save", str(tmp_path / "ckpt"), "--save-interval", "5",
                         "--codecarbon-dir", str(tmp_path / "emissions"))
    output = run_pretrain(args).stdout
    assert [line["iteration"] for line in training_lines(output)] == [1, 2]
    assert "[exiting program at iteration 2] datetime:" in output
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step2"
    assert validation_lines(output) == []  # no end-of-training evaluation after an exit
    emissions = (tmp_path / "emissions" / "emissions-000.csv").read_text().splitlines()
    assert emissions[0].startswith("timestamp,project_name") and len(emissions) >= 2


def test_named_validation_sets(preprocessed_corpus, tmp_path):
    prefix = preprocessed_corpus.data_prefix
    args = tiny_run_args(preprocessed_corpus, "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                         "--tensorboard-dir", str(tmp_path / "tb"))
    args = [arg for arg in args if arg not in ("--data-path", prefix)] + [
        "--train-weighted-split-paths", f"TRAIN: 1 0:0.9 {prefix}",
        "--valid-weighted-split-paths", f"HEAD: 1 0.9:0.95 {prefix}", f"TAIL: 1 0.95:1 {prefix}",
        "--test-weighted-split-paths", f"TEST: 1 0.95:1 {prefix}"]
    output = run_pretrain(args).stdout
    assert [(label, prefix_) for label, prefix_, _, _ in validation_lines(output)] == [
        ("HEAD", "iteration 2"), ("TAIL", "iteration 2"), ("HEAD", "the end of training for val data"),
        ("TAIL", "the end of training for val data"), ("TEST", "the end of training for test data")]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"lm-loss-validation/HEAD/lm loss validation", "lm-loss-validation/TAIL/lm loss validation"} \
        <= set(events.Tags()["scalars"])


def test_kill_switch_during_training_saves_and_stops(preprocessed_corpus, tmp_path):
    switch = tmp_path / "stop"
    args = tiny_run_args(preprocessed_corpus, "--train-iters", "2000", "--eval-iters", "0", "--kill-switch-path",
                         str(switch), "--save", str(tmp_path / "ckpt"), "--save-interval", "1000")
    process = subprocess.Popen([sys.executable, PRETRAIN, *args], cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())})
    output = []
    for line in process.stdout:
        output.append(line)
        if line.startswith(" iteration        3/") and not switch.exists():
            switch.write_text("")
    assert process.wait(timeout=120) == 0
    text = "".join(output)
    last = training_lines(text)[-1]["iteration"]
    assert 3 <= last < 2000
    assert f"Detected kill switch at {switch}. Exiting" in text
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{last}"


def test_rampup_train_samples_and_train_tokens(preprocessed_corpus, tmp_path):
    """Ramp 4 -> 16 by 4 over 48 samples (one increment per 16 samples), stopped by --train-tokens."""
    args = tiny_run_args(preprocessed_corpus, "--global-batch-size", "16", "--train-samples", "160",
                         "--rampup-batch-size", "4", "4", "48", "--lr-warmup-samples", "16", "--train-tokens", "6000",
                         "--eval-iters", "0")
    lines = training_lines(run_pretrain(args).stdout)
    assert [line["global batch size"] for line in lines] == [4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16]
    assert [line["consumed samples"] for line in lines] == [4, 8, 12, 16, 24, 32, 44, 56, 72, 88, 104]
    assert lines[-1]["consumed tokens"] == 104 * SEQ_LENGTH  # the first count >= 6000 tokens
    assert lines[0]["train_iters"] == 14
    assert [line["learning rate"] for line in lines[:4]] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


def test_bad_flag_exits_with_status_2(preprocessed_corpus):
    started = time.time()
    result = run_pretrain(tiny_run_args(preprocessed_corpus, "--train-iters", "3", "--global-batch-size", "3"),
                          check=False)
    assert result.returncode == 2
    assert "--global-batch-size 3" in result.stdout and "Traceback" not in result.stdout
    assert time.time() - started < 60


def test_deterministic_runs_repeat_bit_for_bit(preprocessed_corpus, tmp_path):
    """--deterministic on CPU: torch's deterministic mode raises on no op of the run, and two runs (dropout
    on) log the same losses and gradient norms."""
    args = tiny_run_args(preprocessed_corpus, "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "0",
                         "--deterministic")
    first, second = ([(line["lm loss"], line["grad norm"], line["learning rate"]) for line in
                      training_lines(run_pretrain(args).stdout)] for _ in range(2))
    assert len(first) == 3 and first == second
