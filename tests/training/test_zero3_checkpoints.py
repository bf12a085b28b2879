"""ZeRO-3 checkpoints end to end (fp32, gloo, tiny GPT, every parameter partitioned):

- a ZeRO-3 run at TP = 2 x DP = 2 saved at iteration 2 and resumed continues the uninterrupted run
  exactly (with --no-load-optim, the weights read from the model-states files, its first loss); those
  files hold the whole (gathered) TP slices, one file per TP rank, so the export to transformers
  reads them and gives our model's logits; at TP = 1 DeepSpeed's zero_to_fp32.py, left beside the
  checkpoint, rebuilds the same weights from the optimizer partitions;
- ZeRO-1 -> ZeRO-3 -> ZeRO-1 through universal checkpoints continues the uninterrupted ZeRO-1 run
  within 1e-5 (TP = 2 x DP = 2 both ways).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from tests.training.e2e_utils import run_pretrain, tiny_gpt_flags
from tools.convert_checkpoint import deepspeed_to_transformers, ds_to_universal

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN_ITERS = 4
TP2 = ["--tensor-model-parallel-size", "2"]
PARTITION_EVERYTHING = {"stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0}
VOCABULARY = 1000


def run_flags(data, directory, stage: int) -> list[str]:
    zero = {"stage": stage, **(PARTITION_EVERYTHING if stage == 3 else {})}
    config = directory / f"ds_zero{stage}.json"
    config.write_text(json.dumps({"zero_optimization": zero, "gradient_clipping": 1.0}))
    return tiny_gpt_flags(data) + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--weight-decay", "0.1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization", "--deepspeed",
        "--deepspeed_config", str(config)]


def losses(result) -> dict[int, float]:
    result.assert_ok()
    return {line.iteration: line.number("lm loss") for line in result.log_lines()}


def to_universal(save: str, iteration: int) -> None:
    """CKPT/global_stepN -> CKPT/global_stepN_universal, which latest_universal names."""
    assert ds_to_universal.main(["--input_folder", os.path.join(save, f"global_step{iteration}"), "--output_folder",
                                 os.path.join(save, f"global_step{iteration}_universal"),
                                 "--num_extract_workers", "1"]) == 0


def test_zero_3_resumes_exactly_and_its_model_files_are_whole(e2e_data, tmp_path):
    import transformers

    save, flags = str(tmp_path / "ckpt"), run_flags(e2e_data, tmp_path, 3) + TP2
    reference = losses(run_pretrain(flags + ["--save", save, "--save-interval", "2"], nproc=4))
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    resumed = run_pretrain(flags + ["--load", save], nproc=4)
    assert losses(resumed) == {3: reference[3], 4: reference[4]}
    weights_only = losses(run_pretrain(flags + ["--load", save, "--no-load-optim"], nproc=4))
    assert weights_only[3] == reference[3] and weights_only[4] != reference[4]  # Adam's moments start afresh

    directory = os.path.join(save, "global_step2")
    assert sorted(name for name in os.listdir(directory) if "model_states" in name) == \
        ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    output = str(tmp_path / "hf")
    assert deepspeed_to_transformers.main(["--input_folder", directory, "--output_folder", output]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(output, local_files_only=True).eval()
    ours = load_gpt_model(open_checkpoint(directory))
    tokens = torch.randint(0, VOCABULARY, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, found = ours(tokens)[..., :VOCABULARY], hf_model(tokens).logits
    assert (found - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_zero_to_fp32_rebuilds_the_saved_module_at_tp_1(e2e_data, tmp_path):
    save = tmp_path / "ckpt"
    run_pretrain(run_flags(e2e_data, tmp_path, 3) + ["--train-iters", "2", "--save", str(save),
                                                     "--save-interval", "2"], nproc=2).assert_ok()
    subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(tmp_path / "fp32")], cwd=save, check=True,
                   capture_output=True)
    rebuilt = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=False)
    module = torch.load(save / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert sorted(rebuilt) == sorted(module)
    assert all(torch.equal(rebuilt[name], module[name]) for name in rebuilt)


def test_zero_1_to_zero_3_to_zero_1_through_universal_checkpoints(e2e_data, tmp_path):
    zero_1, zero_3 = run_flags(e2e_data, tmp_path, 1) + TP2, run_flags(e2e_data, tmp_path, 3) + TP2
    first, second = str(tmp_path / "zero1"), str(tmp_path / "zero3")
    reference = losses(run_pretrain(zero_1 + ["--save", first, "--save-interval", "1"], nproc=4))
    to_universal(first, 1)
    at_zero_3 = losses(run_pretrain(zero_3 + ["--load", first, "--universal-checkpoint", "--save", second,
                                              "--save-interval", "2"], nproc=4))
    assert sorted(at_zero_3) == [2, 3, 4]
    assert at_zero_3 == pytest.approx({step: reference[step] for step in (2, 3, 4)}, rel=1e-5)
    to_universal(second, 2)
    back_at_zero_1 = losses(run_pretrain(zero_1 + ["--load", second, "--universal-checkpoint"], nproc=4))
    assert back_at_zero_1 == pytest.approx({3: reference[3], 4: reference[4]}, rel=1e-5)
