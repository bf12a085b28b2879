"""TensorBoard events written by the logger, read back with tensorboard's EventAccumulator."""
import glob
import math
import socket
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.training.throughput import Throughput
from megatron.training.tb_logger import (IterationScalars, Progress, TensorBoardLogger, TensorBoardSettings,
                                         logger_settings)
from megatron.training.wandb_logger import WandbSettings, offline_reason
from megatron.training.timers import Timers

GBS, SEQ = 8, 16
PARAMS_NO_EMBEDDINGS_B = 0.5


def progress_at(iteration):
    samples = iteration * GBS
    return Progress(iteration=iteration, consumed_samples=samples, consumed_tokens=samples * SEQ,
                    gigaflos_no_embeddings=6 * samples * SEQ * PARAMS_NO_EMBEDDINGS_B)


def scalars_at(iteration, loss_scale=None):
    return IterationScalars(learning_rate=1e-4 * iteration, global_batch_size=GBS, losses={"lm loss": 10.0 - iteration},
                            loss_scale=loss_scale, grad_norm=0.5 * iteration, num_zeros=0.0)


def read_events(log_dir):
    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def steps_and_values(accumulator, tag):
    return [(event.step, pytest.approx(event.value)) for event in accumulator.Scalars(tag)]


def write_short_run(log_dir, **settings):
    logger = TensorBoardLogger(TensorBoardSettings(log_dir=str(log_dir), **settings), enabled=True)
    logger.write_run_start({"lr": 0.0001, "micro_batch_size": 2}, iteration=0, world_size=4)
    for iteration in range(1, 5):
        logger.write_iteration(progress_at(iteration), scalars_at(iteration, loss_scale=2.0 ** 16))
    throughput = Throughput(iteration_time=0.25, samples_per_second=32.0, samples_per_second_per_replica=8.0,
                            tokens_per_second=512.0, tokens_per_second_per_replica=128.0, tflops=1.5,
                            model_tflops=1.2, mfu=0.4)
    logger.write_throughput(progress_at(4), throughput)
    logger.write_timers(4, {"forward-compute": 0.125})
    logger.write_validation(progress_at(4), {"lm loss": 3.0})
    logger.write_validation(progress_at(4), {"lm loss": 25.0}, group_name="ARXIV")
    logger.write_validation(progress_at(4), {"lm loss": 4.0}, split="test")
    logger.close()


def test_tags_and_x_axes_in_iterations_samples_and_tokens(tmp_path):
    write_short_run(tmp_path, log_timers=True, log_batch_size=True, log_validation_ppl=True)
    events = read_events(str(tmp_path))
    tags = set(events.Tags()["scalars"])
    expected = {
        "steps-vs-samples/y=steps,x=samples", "steps-vs-samples/y=samples,x=steps",
        "steps-vs-tokens/y=steps,x=tokens", "steps-vs-tokens/y=tokens,x=steps",
        "learning-rate/learning-rate", "learning-rate/learning-rate vs samples", "learning-rate/learning-rate vs tokens",
        "batch-size/batch-size", "batch-size/batch-size vs samples",
        "lm-loss-training/lm loss", "lm-loss-training/lm loss vs samples", "lm-loss-training/lm loss vs tokens",
        "lm-loss-training/lm loss vs gigaflos (without embeddings)",
        "loss-scale/loss-scale", "loss-scale/loss-scale vs samples", "loss-scale/loss-scale vs tokens",
        "grad-norm/grad-norm", "grad-norm/grad-norm vs samples", "grad-norm/grad-norm vs tokens",
        "num-zeros/num-zeros", "num-zeros/num-zeros vs samples", "num-zeros/num-zeros vs tokens",
        "iteration-time/world_size",
        "iteration-time/iteration-time", "iteration-time/iteration-time vs samples",
        "iteration-time/iteration-time vs tokens", "iteration-time/samples per second",
        "iteration-time/samples per second per replica", "iteration-time/tokens per second",
        "iteration-time/tokens per second per replica", "iteration-time/TFLOPs per gpu (estimated)",
        "iteration-time/model TFLOP/s per gpu", "iteration-time/MFU",
        "time/forward-compute-time",
    }
    for prefix, split in (("lm-loss-validation", "validation"), ("lm-loss-validation/ARXIV", "validation"),
                          ("lm-loss-test", "test")):
        for suffix in ("", " ppl"):
            expected |= {f"{prefix}/lm loss {split}{suffix}{axis}"
                         for axis in ("", " vs samples", " vs tokens", " vs gigaflos (without embeddings)")}
    assert tags == expected

    assert steps_and_values(events, "lm-loss-training/lm loss") == [(i, 10.0 - i) for i in range(1, 5)]
    assert steps_and_values(events, "lm-loss-training/lm loss vs samples") == [(8 * i, 10.0 - i) for i in range(1, 5)]
    assert steps_and_values(events, "lm-loss-training/lm loss vs tokens") == [(128 * i, 10.0 - i) for i in range(1, 5)]
    assert steps_and_values(events, "lm-loss-training/lm loss vs gigaflos (without embeddings)") == \
        [(int(6 * 8 * i * 16 * 0.5), 10.0 - i) for i in range(1, 5)]
    assert steps_and_values(events, "steps-vs-samples/y=samples,x=steps") == [(i, 8 * i) for i in range(1, 5)]
    assert steps_and_values(events, "steps-vs-tokens/y=steps,x=tokens") == [(128 * i, i) for i in range(1, 5)]
    assert steps_and_values(events, "learning-rate/learning-rate vs tokens") == [(128 * i, 1e-4 * i) for i in range(1, 5)]
    assert steps_and_values(events, "batch-size/batch-size vs samples") == [(8 * i, 8) for i in range(1, 5)]
    assert steps_and_values(events, "iteration-time/world_size") == [(0, 4)]
    assert steps_and_values(events, "iteration-time/iteration-time vs tokens") == [(512, 0.25)]
    assert steps_and_values(events, "time/forward-compute-time") == [(4, 0.125)]
    assert steps_and_values(events, "lm-loss-validation/lm loss validation vs samples") == [(32, 3.0)]
    assert steps_and_values(events, "lm-loss-test/lm loss test") == [(4, 4.0)]
    assert steps_and_values(events, "lm-loss-validation/ARXIV/lm loss validation ppl vs tokens") == \
        [(512, math.exp(20))]


def test_arguments_are_written_as_text(tmp_path):
    write_short_run(tmp_path)
    events = read_events(str(tmp_path))
    text_tags = set(events.Tags()["tensors"])
    assert {"lr/text_summary", "micro_batch_size/text_summary"} <= text_tags
    assert events.Tensors("lr/text_summary")[0].tensor_proto.string_val == [b"0.0001"]


def test_flags_switch_tags_off(tmp_path):
    write_short_run(tmp_path, log_learning_rate=False, log_loss_scale=False)
    tags = set(read_events(str(tmp_path)).Tags()["scalars"])
    assert not any(tag.startswith(("learning-rate/", "loss-scale/", "batch-size/", "iteration-time/i",
                                   "time/", "lm-loss-validation/lm loss validation ppl")) for tag in tags)
    assert "lm-loss-training/lm loss" in tags and "iteration-time/world_size" in tags


def test_tensorboard_log_interval_and_optional_scalars(tmp_path):
    logger = TensorBoardLogger(TensorBoardSettings(log_dir=str(tmp_path), log_interval=2), enabled=True)
    for iteration in range(1, 6):
        scalars = IterationScalars(learning_rate=1.0, global_batch_size=GBS, losses={"lm loss": 1.0},
                                   params_norm=3.0, curriculum_seqlen=64)
        logger.write_iteration(progress_at(iteration), scalars)
    logger.close()
    events = read_events(str(tmp_path))
    assert [e.step for e in events.Scalars("lm-loss-training/lm loss")] == [2, 4]
    assert steps_and_values(events, "params-norm/params-norm vs samples") == [(16, 3.0), (32, 3.0)]
    assert steps_and_values(events, "curriculum_seqlen") == [(2, 64), (4, 64)]
    tags = set(events.Tags()["scalars"])
    assert not any(tag.startswith(("loss-scale/", "grad-norm/", "num-zeros/")) for tag in tags)


def test_timers_write_through_the_logger(tmp_path):
    logger = TensorBoardLogger(TensorBoardSettings(log_dir=str(tmp_path), log_timers=True), enabled=True)
    timers = Timers(synchronize=False)
    timers("optimizer").start()
    timers("optimizer").stop()
    timers.write(["optimizer"], logger, iteration=3, normalizer=2.0)
    logger.close()
    events = read_events(str(tmp_path))
    assert [e.step for e in events.Scalars("time/optimizer-time")] == [3]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = TensorBoardLogger(TensorBoardSettings(log_dir=str(tmp_path)), enabled=False)
    logger.write_run_start({"lr": 1}, iteration=0, world_size=2)
    logger.write_iteration(progress_at(1), scalars_at(1))
    logger.write_validation(progress_at(1), {"lm loss": 1.0})
    logger.close()
    assert not logger.active and glob.glob(str(tmp_path / "*")) == []
    assert not TensorBoardLogger(None, enabled=True).active
    wandb = WandbSettings(project="p", name=None, directory=str(tmp_path / "wandb"))
    assert not TensorBoardLogger(TensorBoardSettings(log_dir=None), enabled=False, wandb=wandb).active
    assert glob.glob(str(tmp_path / "*")) == []


def test_each_restart_opens_a_new_events_file(tmp_path):
    for restart in range(2):
        logger = TensorBoardLogger(TensorBoardSettings(log_dir=str(tmp_path)), enabled=True)
        logger.write_run_start({}, iteration=4 * restart, world_size=1)
        logger.close()
    assert len(glob.glob(str(tmp_path / "events.out.tfevents.*"))) == 2
    assert steps_and_values(read_events(str(tmp_path)), "iteration-time/world_size") == [(0, 1), (4, 1)]


@pytest.mark.parametrize("field, flag", [("queue_size", "--tensorboard-queue-size"),
                                         ("log_interval", "--tensorboard-log-interval")])
def test_invalid_settings(tmp_path, field, flag):
    with pytest.raises(ValueError, match=flag):
        TensorBoardSettings(log_dir=str(tmp_path), **{field: 0})


def logging_config(**given):
    fields = dict(tensorboard_dir=None, tensorboard_queue_size=7, tensorboard_log_interval=3,
                  log_timers_to_tensorboard=True, log_batch_size_to_tensorboard=False,
                  log_learning_rate_to_tensorboard=True, log_loss_scale_to_tensorboard=False,
                  log_validation_ppl_to_tensorboard=True, wandb_project=None, wandb_exp_name=None, wandb_save_dir=None)
    return SimpleNamespace(**{**fields, **given})


def test_wandb_takes_the_tensorboard_flags_with_or_without_a_tensorboard_dir():
    assert logger_settings(logging_config()) == (None, None)
    settings, wandb = logger_settings(logging_config(wandb_project="p", wandb_exp_name="run", wandb_save_dir="/w"))
    assert wandb == WandbSettings(project="p", name="run", directory="/w")
    assert settings == TensorBoardSettings(log_dir=None, queue_size=7, log_interval=3, log_timers=True,
                                           log_batch_size=False, log_learning_rate=True, log_loss_scale=False,
                                           log_validation_ppl=True)
    settings, wandb = logger_settings(logging_config(tensorboard_dir="/tb"))
    assert settings.log_dir == "/tb" and wandb is None


def test_wandb_goes_offline_without_an_api_key_or_a_server():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        listening = f"http://127.0.0.1:{server.getsockname()[1]}"
        assert "no W&B API key" in offline_reason({"WANDB_BASE_URL": listening})
        assert offline_reason({"WANDB_BASE_URL": listening, "WANDB_API_KEY": "k"}) is None
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        unreachable = f"http://127.0.0.1:{closed.getsockname()[1]}"
    assert offline_reason({"WANDB_BASE_URL": unreachable, "WANDB_API_KEY": "k"}) == \
        "the W&B server 127.0.0.1 cannot be reached"
