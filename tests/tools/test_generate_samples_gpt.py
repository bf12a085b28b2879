"""tools/generate_samples_gpt.py on the session's checkpoint trained under TP=2 x PP=2
(tests/tasks/trained_checkpoint.py), launched like training (gloo, one process a rank).

* Greedy: the same tokens under TP=1, TP=2, PP=2 and the saved TP=2 x PP=2, with the cache and
  without (--recompute); and they are what transformers' GPT2LMHeadModel generates from the
  checkpoint's weights. Sampling (--temperature, --top_k, --top_p, --seed): TP=2 x PP=2 draws what
  TP=1 draws, and another --seed draws otherwise.
* The output files: Megatron's text form (--sample-output-file) and --genfile's JSON lines; the
  unconditional mode (--num-samples) and the interactive one; bad flags and prompts named.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.tokenizer import GPT2BPETokenizer
from tests.conftest import REPO_ROOT
from tests.core.text_generation.test_generation import transformers_model
from tests.tasks.trained_checkpoint import checkpoint_path, model_flags
from tests.training.e2e_utils import run_command, run_script, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TOOL = os.path.join(REPO_ROOT, "tools", "generate_samples_gpt.py")
PROMPTS = ["The history of the", "In 1990, a new", "Valkyria", "It was not until the second half of", "Rome"]
NEW_TOKENS = 12
LAYOUTS = {"TP1": (1, 1), "TP2": (2, 1), "PP2": (1, 2), "TP2xPP2": (2, 2)}
SAMPLING = ["--temperature", "1.5", "--top_k", "50", "--top_p", "0.95"]


def run_tool(trained, tmp_path, name, tp, pp, *flags, stdin=None):
    """The tool on ``tp`` x ``pp`` processes with the prompts file; (genfile samples, result)."""
    data, save = trained
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    genfile = tmp_path / f"{name}.jsonl"
    command = [TOOL, "--load", save, *model_flags(data), "--tensor-model-parallel-size", str(tp),
                        "--pipeline-model-parallel-size", str(pp), "--out-seq-length", str(NEW_TOKENS),
                        "--micro-batch-size", "3", "--sample-input-file", str(prompts),
                        "--sample-output-file", str(tmp_path / f"{name}.out"), "--genfile", str(genfile), *flags]
    run_script(command, tp * pp, timeout=240).assert_ok()
    return [json.loads(line) for line in genfile.read_text().splitlines()]


@pytest.fixture(scope="module")
def greedy_runs(trained, tmp_path_factory):
    directory = tmp_path_factory.mktemp("greedy")
    runs = {name: run_tool(trained, directory, name, tp, pp, "--greedy") for name, (tp, pp) in LAYOUTS.items()}
    runs["TP1 --recompute"] = run_tool(trained, directory, "recompute", 1, 1, "--greedy", "--recompute")
    return runs, directory


def test_greedy_tokens_equal_across_layouts_and_transformers(greedy_runs, trained):
    runs, directory = greedy_runs
    reference = runs["TP1"]
    assert [sample["prompt"] for sample in reference] == PROMPTS
    for name, samples in runs.items():
        assert [s["tokens"] for s in samples] == [s["tokens"] for s in reference], name

    data, save = trained
    ours = load_gpt_model(open_checkpoint(checkpoint_path(save)))
    tokenizer = GPT2BPETokenizer(data.vocab_file, data.merge_file)
    hf_model = transformers_model(ours, tokenizer.vocab_size, tokenizer.eod)
    for prompt, sample in zip(PROMPTS, reference):
        ids = tokenizer.tokenize(prompt)
        output = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   eos_token_id=tokenizer.eod, pad_token_id=tokenizer.eod,
                                   attention_mask=torch.ones(1, len(ids)))
        assert output[0, len(ids):].tolist() == sample["tokens"]
        assert sample["text"] == tokenizer.detokenize(sample["tokens"])
    text = (directory / "TP2xPP2.out").read_text()
    assert text == "".join(f"\nContext:{s['prompt']}\n\nMegatron-LM:{s['text']}\n" for s in reference)


def test_sampling_repeats_across_layouts_under_a_seed(trained, tmp_path):
    single = run_tool(trained, tmp_path, "sampled_tp1", 1, 1, *SAMPLING, "--seed", "5")
    split = run_tool(trained, tmp_path, "sampled_tp2pp2", 2, 2, *SAMPLING, "--seed", "5")
    other = run_tool(trained, tmp_path, "sampled_seed6", 1, 1, *SAMPLING, "--seed", "6")
    assert [s["tokens"] for s in split] == [s["tokens"] for s in single]
    assert [s["tokens"] for s in other] != [s["tokens"] for s in single]


def test_unconditional_interactive_and_errors(trained, tmp_path):
    data, save = trained
    base = [sys.executable, TOOL, "--load", save, *model_flags(data), "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1", "--out-seq-length", "6"]
    genfile = tmp_path / "unconditional.jsonl"
    run_command(base + ["--num-samples", "3", "--genfile", str(genfile), "--micro-batch-size", "2"]).assert_ok()
    samples = [json.loads(line) for line in genfile.read_text().splitlines()]
    assert len(samples) == 3 and all(s["prompt"] == "" and 0 < len(s["tokens"]) <= 6 for s in samples)

    interactive = subprocess.run(base + ["--greedy"], input="\nThe history of the\nstop\n", capture_output=True,
                                 text=True, env=subprocess_env(), timeout=120, cwd=REPO_ROOT)
    assert interactive.returncode == 0, interactive.stderr[-3000:]
    assert "Prompt should not be empty!" in interactive.stdout
    assert interactive.stdout.count("Context prompt (stop to exit) >>> ") == 3
    assert "\nContext:The history of the\n\nMegatron-LM:" in interactive.stdout

    missing = run_command(base + ["--num-samples", "2"])
    assert missing.returncode == 2 and "give --genfile PATH" in missing.output
    bad = tmp_path / "bad.txt"
    bad.write_text("fine\n\n")
    empty_line = run_command(base + ["--sample-input-file", str(bad)])
    assert empty_line.returncode == 2 and f"{bad}:2: empty prompt" in empty_line.output
    assert run_command(base + ["--top_p", "2"]).output.count("--top_p 2.0: must be in [0, 1]") == 1
