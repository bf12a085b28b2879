"""tasks/main.py on the Llama-class checkpoint (parallel_3d_runs.llama_saving_run: RMSNorm, 4 heads over
2 key/value groups, SwiGLU, rotary base 500000, untied output layer, no biases; saved under TP=2 x PP=2
at iteration 2): launched on 4 gloo ranks under the saved layout, the WikiText-103 perplexity and the
plain and strict LAMBADA accuracies equal those of the one-process model (rel 1e-6), which test_main.py
checks against a recomputation from logits for the GPT checkpoint.
"""
import dataclasses
import json
import os

import pytest

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.tokenizer import GPT2BPETokenizer
from tasks.main import evaluate_task
from tests.core.evaluation.test_zeroshot import WIKITEXT
from tests.tasks.test_main import MICRO_BATCH, WORKER, lambada_passages, task_arguments, task_flags
from tests.training.e2e_utils import run_ranks
from tests.training.parallel_3d_runs import (LLAMA_MODEL_FLAGS, LLAMA_NUM_LAYERS, LLAMA_SAVE_ITERATION,
                                             LLAMA_SEQ_LENGTH)
from tests.training.test_layout_equivalence import MAX_POSITIONS

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def llama_model_flags(data) -> list[str]:
    """The checkpoint's model and tokenizer flags, as an evaluation command line repeats them."""
    return ["--num-layers", str(LLAMA_NUM_LAYERS), "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(LLAMA_SEQ_LENGTH), "--max-position-embeddings", str(MAX_POSITIONS),
            "--pad-vocab-size-to", "1152", "--vocab-file", data.vocab_file, "--merge-file", data.merge_file,
            *LLAMA_MODEL_FLAGS]


def test_tp2_pp2_launch_equals_one_process(llama_saving_run, e2e_data, tmp_path):
    tag = os.path.join(str(llama_saving_run["save"]), f"global_step{LLAMA_SAVE_ITERATION}")
    model = load_gpt_model(open_checkpoint(tag))
    assert model.output_layer is not None and model.config.num_query_groups == 2
    tokenizer = GPT2BPETokenizer(e2e_data.vocab_file, e2e_data.merge_file)
    paths = {"wiki.test.tokens": str(tmp_path / "wiki.test.tokens"), "lambada.jsonl": str(tmp_path / "lambada.jsonl")}
    (tmp_path / "wiki.test.tokens").write_text(WIKITEXT, encoding="utf-8")
    passages = lambada_passages(model, tokenizer)
    (tmp_path / "lambada.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in passages))
    output = tmp_path / "figures.json"
    run_ranks([WORKER, "--load", tag, *llama_model_flags(e2e_data), *task_arguments("WIKITEXT103", paths),
               "--lambada-data", paths["lambada.jsonl"], "--output", str(output)], 4, timeout=240).assert_ok()
    found = json.loads(output.read_text())
    for name, task, strict in (("WIKITEXT103", "WIKITEXT103", False), ("LAMBADA", "LAMBADA", False),
                               ("LAMBADA strict", "LAMBADA", True)):
        path = paths["wiki.test.tokens" if task == "WIKITEXT103" else "lambada.jsonl"]
        expected = dataclasses.asdict(evaluate_task(task_flags(task, path, strict), MICRO_BATCH, model, tokenizer,
                                                    LLAMA_SEQ_LENGTH))
        assert found[name] == pytest.approx(expected, rel=1e-6)
