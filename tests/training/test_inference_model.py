"""megatron/training/inference_model.py on the session's checkpoint trained under TP=2 x PP=2
(tests/tasks/trained_checkpoint.py), and on one of the plain engine (ZeRO-2, TP=2) with ALiBi, an
embedding LayerNorm and a SwiGLU MLP (trained here for one iteration).

Launched like training (one process a rank, gloo), the logits of two token rows equal, on every rank, those of
the checkpoint merged into one GPTModel (megatron.core.checkpoint.model_loading): under the saved
layout (each rank reads its own partition files) and re-cut to TP=1 x PP=1 and TP=1 x PP=2; the
plain-engine checkpoint under TP=2 and TP=1 x PP=2, with only --load and the tokenizer given. Wrong
flags are refused by name before any process group starts (a model flag given at its default
too); the command line is split once into the tool's flags and the trainer's.
"""
import json
import os
import shutil

import pytest
import torch

from megatron.core.checkpoint.manifest import MANIFEST_NAME
from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import CheckpointInputError, open_checkpoint
from megatron.training.argument_types import ArgumentError
from megatron.training.inference_model import InferenceSetupError, load_inference_model, parse_inference_arguments
from tests.conftest import REPO_ROOT
from tests.tasks.trained_checkpoint import checkpoint_path, model_flags
from tests.training.e2e_utils import run_pretrain, run_script
from tests.training.test_layout_equivalence import common_flags

WORKER = os.path.join(REPO_ROOT, "tests", "training", "inference_worker.py")
TOKENS = [[5, 17, 300, 2, 999, 41, 8, 8, 120], [900, 3, 3, 64, 1, 0, 77, 512, 6]]
LAYOUTS = {"saved TP2 x PP2": (4, []),
           "TP1 x PP1": (1, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]),
           "TP1 x PP2": (2, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"])}


PLAIN_ENGINE_LAYOUTS = {"TP2 (saved)": (2, []),
                        "TP1 x PP2": (2, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"])}
PLAIN_ENGINE_MODEL = ["--position-embedding-type", "alibi", "--embed-layernorm", "--glu-activation", "swiglu",
                      "--no-bias-gelu-fusion"]


def load_from_argv(argv: list[str]):
    return load_inference_model(parse_inference_arguments(argv))


def merged_logits_of(save: str) -> torch.Tensor:
    model = load_gpt_model(open_checkpoint(save))
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).float()


@pytest.fixture(scope="module")
def merged_logits(trained):
    return merged_logits_of(checkpoint_path(trained[1]))


@pytest.fixture(scope="module")
def plain_engine_checkpoint(e2e_data, tmp_path_factory):
    """(corpus, --save) of one ZeRO-2 iteration under TP=2: ALiBi, embedding LayerNorm, SwiGLU."""
    data = e2e_data
    save = str(tmp_path_factory.mktemp("zero2") / "checkpoints")
    flags = common_flags(data, seq_length=32, num_layers=2, global_batch=2, train_iters=1)
    run_pretrain(flags + PLAIN_ENGINE_MODEL + ["--tensor-model-parallel-size", "2", "--zero-stage", "2",
                                               "--save", save, "--save-interval", "1"], nproc=2, timeout=300).assert_ok()
    return data, save


def run_worker(processes: int, flags: list[str], tmp_path) -> list[dict]:
    """The worker on ``processes`` ranks; what each rank wrote."""
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(TOKENS))
    output = str(tmp_path / "logits")
    run_script([WORKER, *flags, "--tokens-json", str(tokens_file), "--output", output], processes,
               timeout=180).assert_ok()
    return [torch.load(f"{output}.{rank}") for rank in range(processes)]


def check_ranks(saved: list[dict], expected: torch.Tensor, stages: int) -> None:
    for rank_output in saved:
        torch.testing.assert_close(rank_output["logits"], expected, rtol=0, atol=1e-5)
    assert len({tuple(rank_output["stage_layers"]) for rank_output in saved}) == stages


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_on_every_rank_equal_the_merged_model(layout, trained, merged_logits, tmp_path):
    data, save = trained
    processes, flags = LAYOUTS[layout]
    saved = run_worker(processes, ["--load", save, *model_flags(data), *flags], tmp_path)
    check_ranks(saved, merged_logits, 2 if "PP2" in layout else 1)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", PLAIN_ENGINE_LAYOUTS)
def test_plain_engine_alibi_glu_checkpoint(layout, plain_engine_checkpoint, tmp_path):
    data, save = plain_engine_checkpoint
    processes, flags = PLAIN_ENGINE_LAYOUTS[layout]
    tokenizer = ["--vocab-file", data.vocab_file, "--merge-file", data.merge_file]
    saved = run_worker(processes, ["--load", save, *tokenizer, *flags], tmp_path)
    check_ranks(saved, merged_logits_of(save), 2 if "PP2" in layout else 1)


@pytest.mark.slow
def test_wrong_flags_are_refused_before_starting(trained, monkeypatch):
    data, save = trained
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InferenceSetupError, match="--hidden-size 128: the checkpoint at --load"):
        load_from_argv(["--load", save, *model_flags(data), "--hidden-size", "128"])
    with pytest.raises(InferenceSetupError, match="1 processes cannot hold TP 2 x PP 2"):
        load_from_argv(["--load", save, *model_flags(data)])
    with pytest.raises(InferenceSetupError, match="give --load"):
        load_from_argv(model_flags(data))
    with pytest.raises(InferenceSetupError, match="--seq-length 100: the model has 80 positions"):
        load_from_argv(["--load", save, *model_flags(data), "--seq-length", "100",
                        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"])
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_a_model_flag_given_at_its_default_must_still_be_the_checkpoints(plain_engine_checkpoint, monkeypatch):
    """--position-embedding-type absolute is the parser's default, and given explicitly it names a
    model that the ALiBi checkpoint is not."""
    data, save = plain_engine_checkpoint
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    tokenizer = ["--vocab-file", data.vocab_file, "--merge-file", data.merge_file]
    with pytest.raises(InferenceSetupError, match="--position-embedding-type absolute: the checkpoint at --load .* "
                                                  "was trained with alibi"):
        load_from_argv(["--load", save, *tokenizer, "--position-embedding-type", "absolute"])
    assert not torch.distributed.is_initialized()


def test_a_checkpoint_without_its_manifest_loads_only_with_the_flag(trained, tmp_path, monkeypatch, capsys):
    data, save = trained
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    copy = tmp_path / "checkpoints"
    shutil.copytree(save, copy)
    os.remove(os.path.join(checkpoint_path(str(copy)), MANIFEST_NAME))
    with pytest.raises(CheckpointInputError, match="--allow-missing-manifest"):
        load_from_argv(["--load", str(copy), *model_flags(data)])
    with pytest.raises(InferenceSetupError, match="1 processes cannot hold TP 2 x PP 2"):  # past the checkpoint
        load_from_argv(["--load", str(copy), *model_flags(data), "--allow-missing-manifest"])
    assert "UNVERIFIED" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(checkpoint_path(str(copy)), MANIFEST_NAME))


def add_tool_flags(parser):
    parser.add_argument("--out-seq-length", type=int, default=8)
    parser.add_argument("--genfile", required=True)


def test_the_command_line_is_parsed_once_into_the_tools_and_the_trainers_flags(capsys):
    """The tool's flags are taken out wherever they stand; the rest are the trainer's, with the dests
    given (a TP of 1, the default, given explicitly overrides the checkpoint's); unknown and
    missing flags are named; --help lists both."""
    arguments = parse_inference_arguments(["--load", "ckpt", "--genfile", "out.jsonl", "--data-path", "a", "b",
                                           "--out-seq-length=5", "--tensor-model-parallel-size", "1"],
                                          add_tool_flags)
    assert (arguments.tool.genfile, arguments.tool.out_seq_length) == ("out.jsonl", 5)
    assert (arguments.flags.load, arguments.flags.data_path, arguments.flags.tensor_model_parallel_size) == \
        ("ckpt", ["a", "b"], 1)
    assert arguments.explicit == {"load", "data_path", "tensor_model_parallel_size"}
    assert not hasattr(arguments.flags, "genfile") and not hasattr(arguments.tool, "load")
    with pytest.raises(ArgumentError, match="--no-such-flag"):
        parse_inference_arguments(["--genfile", "x", "--no-such-flag"], add_tool_flags)
    with pytest.raises(ArgumentError, match="--genfile"):
        parse_inference_arguments(["--load", "ckpt"], add_tool_flags)
    with pytest.raises(SystemExit) as exit_info:
        parse_inference_arguments(["--help"], add_tool_flags)
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--out-seq-length" in help_text and "--tensor-model-parallel-size" in help_text
