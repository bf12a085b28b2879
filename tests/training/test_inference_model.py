"""megatron/training/inference_model.py on the session's checkpoint trained under TP=2 x PP=2
(tests/tasks/trained_checkpoint.py).

Launched like training (torchrun, gloo), the logits of two token rows equal, on every rank, those of
the checkpoint merged into one GPTModel (megatron.core.checkpoint.model_loading): under the saved
layout (each rank reads its own partition files) and re-cut to TP=1 x PP=1 and TP=1 x PP=2. Wrong
flags are refused by name before any process group starts.
"""
import json
import os

import pytest
import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.training.inference_model import InferenceSetupError, load_inference_model
from tests.conftest import REPO_ROOT
from tests.tasks.trained_checkpoint import checkpoint_path, model_flags, trained  # noqa: F401
from tests.training.e2e_utils import run_command, torchrun_command

WORKER = os.path.join(REPO_ROOT, "tests", "training", "inference_worker.py")
TOKENS = [[5, 17, 300, 2, 999, 41, 8, 8, 120], [900, 3, 3, 64, 1, 0, 77, 512, 6]]
LAYOUTS = {"saved TP2 x PP2": (4, []),
           "TP1 x PP1": (1, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]),
           "TP1 x PP2": (2, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"])}


@pytest.fixture(scope="module")
def merged_logits(trained):  # noqa: F811
    _, save = trained
    model = load_gpt_model(open_checkpoint(checkpoint_path(save)))
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).float()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_on_every_rank_equal_the_merged_model(layout, trained, merged_logits, tmp_path):  # noqa: F811
    data, save = trained
    processes, flags = LAYOUTS[layout]
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(TOKENS))
    output = str(tmp_path / "logits")
    command = torchrun_command(processes) + [WORKER, "--load", save, *model_flags(data), *flags,
                                             "--tokens-json", str(tokens_file), "--output", output]
    run_command(command, timeout=180).assert_ok()
    stages = set()
    for rank in range(processes):
        saved = torch.load(f"{output}.{rank}")
        torch.testing.assert_close(saved["logits"], merged_logits, rtol=0, atol=1e-5)
        stages.add(tuple(saved["stage_layers"]))
    assert len(stages) == (2 if "PP2" in layout else 1)


@pytest.mark.slow
def test_wrong_flags_are_refused_before_starting(trained, monkeypatch):  # noqa: F811
    data, save = trained
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InferenceSetupError, match="--hidden-size 128: the checkpoint at --load"):
        load_inference_model(["--load", save, *model_flags(data), "--hidden-size", "128"])
    with pytest.raises(InferenceSetupError, match="1 processes cannot hold TP 2 x PP 2"):
        load_inference_model(["--load", save, *model_flags(data)])
    with pytest.raises(InferenceSetupError, match="give --load"):
        load_inference_model(model_flags(data))
    with pytest.raises(InferenceSetupError, match="--seq-length 100: the model has 80 positions"):
        load_inference_model(["--load", save, *model_flags(data), "--seq-length", "100",
                              "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"])
    assert not torch.distributed.is_initialized()
