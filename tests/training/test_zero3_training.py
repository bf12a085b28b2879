"""ZeRO-3 end to end (fp32, gloo, pretrain_gpt.py on the tiny GPT): the model built partitioned under
zero.Init trains to ZeRO-1's losses at DP = 2 and at TP = 2 x DP = 2 (tied embeddings, sequence
parallelism and activation checkpointing in the second), and so it does with its parameters and
optimizer offloaded to the CPU: by the ds_config (DeepSpeed's CPU Adam), and by Microsoft
Megatron-DeepSpeed's flags (--remote-device cpu --cpu-optimizer --cpu_torch_adam: torch's AdamW on
the CPU), both with the optimizer's fp32 gradients sharing the accumulation buffer (over two
micro-batches per step). In bf16 it says that the BF16_Optimizer's step replacements are off and stays within
bf16's rounding of those losses. The ds_config sets DeepSpeed's persistence thresholds to 0, so
that every parameter of the tiny model is partitioned and gathered around each use (by default
DeepSpeed keeps parameters under 100k elements whole on every rank).

The ZeRO-1 reference runs are launched once per layout (a module fixture).
"""
import json

import pytest

from megatron.training.engine.deepspeed_engine import SHARED_GRADIENTS_LINE, ZERO3_STEPS_LINE
from tests.training.e2e_utils import run_pretrain, tiny_gpt_flags

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN_ITERS = 4
LAYOUTS = {"dp2": (2, []), "tp2-dp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                          "--checkpoint-activations"])}
PARTITION_EVERYTHING = {"stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0}


def run_flags(data) -> list[str]:
    return tiny_gpt_flags(data) + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--weight-decay", "0.1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization", "--deepspeed"]


def ds_config(directory, stage: int, **zero) -> str:
    path = directory / f"ds_zero{stage}_{len(list(directory.iterdir()))}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage, **zero}, "gradient_clipping": 1.0}))
    return str(path)


def losses(result) -> dict[int, float]:
    result.assert_ok()
    return {line.iteration: line.number("lm loss") for line in result.log_lines()}


@pytest.fixture(scope="module")
def zero_1_losses(e2e_data, tmp_path_factory):
    """{layout: ZeRO-1's losses} for the layouts of LAYOUTS."""
    directory = tmp_path_factory.mktemp("zero1")
    return {name: losses(run_pretrain(run_flags(e2e_data) + extra + ["--deepspeed_config", ds_config(directory, 1)],
                                      nproc=nproc))
            for name, (nproc, extra) in LAYOUTS.items()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_zero_3_gives_the_losses_of_zero_1(zero_1_losses, e2e_data, tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    result = run_pretrain(run_flags(e2e_data) + extra +
                          ["--deepspeed_config", ds_config(tmp_path, 3, **PARTITION_EVERYTHING)], nproc=nproc)
    reference = zero_1_losses[layout]
    assert sorted(reference) == list(range(1, TRAIN_ITERS + 1))
    assert losses(result) == pytest.approx(reference, rel=1e-5)


def test_zero_3_with_cpu_offload_gives_the_losses_of_zero_1(zero_1_losses, e2e_data, tmp_path):
    offload = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    config = ds_config(tmp_path, 3, **PARTITION_EVERYTHING, **offload)
    result = run_pretrain(run_flags(e2e_data) + ["--deepspeed_config", config], nproc=2)
    assert losses(result) == pytest.approx(zero_1_losses["dp2"], rel=1e-5)
    assert result.output.count(SHARED_GRADIENTS_LINE) == 1  # the CPU Adam read the accumulation buffer itself


def test_microsoft_offload_flags_give_the_losses_of_zero_1(zero_1_losses, e2e_data, tmp_path):
    flags = ["--deepspeed_config", ds_config(tmp_path, 3, **PARTITION_EVERYTHING), "--remote-device", "cpu",
             "--cpu-optimizer", "--cpu_torch_adam"]
    result = run_pretrain(run_flags(e2e_data) + flags, nproc=2)
    assert losses(result) == pytest.approx(zero_1_losses["dp2"], rel=1e-5)
    assert result.output.count(SHARED_GRADIENTS_LINE) == 1


def test_bf16_at_zero_3_says_the_step_replacements_are_off(zero_1_losses, e2e_data, tmp_path):
    """bf16 runs at ZeRO-3 (DeepSpeed's stage-3 optimizer, not its BF16_Optimizer), says so at start,
    and stays within bf16's rounding of the fp32 losses."""
    result = run_pretrain(run_flags(e2e_data) + ["--bf16", "--deepspeed_config",
                                                 ds_config(tmp_path, 3, **PARTITION_EVERYTHING)], nproc=2)
    assert result.output.count(ZERO3_STEPS_LINE) == 1
    assert losses(result) == pytest.approx(zero_1_losses["dp2"], rel=1e-3)
