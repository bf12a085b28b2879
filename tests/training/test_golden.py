"""Golden run: a tiny fixed configuration whose per-iteration losses are stored in the repository.

The run: the sample corpus tokenized with the session's 4k BPE (tests/fixtures_tokenizer.py), a
2-layer GPT (h 64, 4 heads, s 64), fp32, dropout 0, --use-cpu-initialization, --seed 1234, one
process, 8 iterations of 4 samples, cosine decay after 2 warmup iterations. Any change of the
numerics of the model, the data pipeline, the optimizer, the clipping or the LR schedule moves the
losses; the comparison allows 1e-5 relative (fp32 summation order across CPUs), the grad norms
2e-3 absolute (the log prints three decimals).

After an intended numerical change, regenerate and commit the file:

    MEGATRON_REGENERATE_GOLDEN=1 python3 -m pytest -q tests/training/test_golden.py
"""
import json
import os

import pytest

from tests.training.pretrain_helpers import (run_pretrain, tiny_run_args,
                                             training_lines, validation_lines)

GOLDEN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_gpt_fp32.json")
REGENERATE_ENV = "MEGATRON_REGENERATE_GOLDEN"
GOLDEN_FLAGS = ["--global-batch-size", "4", "--train-iters", "8", "--lr-warmup-iters", "2", "--lr-decay-style",
                "cosine", "--min-lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
                "--use-cpu-initialization", "--seed", "1234", "--eval-interval", "8", "--eval-iters", "1"]


def _measure(corpus) -> dict:
    output = run_pretrain(tiny_run_args(corpus, *GOLDEN_FLAGS)).stdout
    lines = training_lines(output)
    return {"flags": GOLDEN_FLAGS,
            "lm_loss": [line["lm loss"] for line in lines],
            "grad_norm": [line["grad norm"] for line in lines],
            "learning_rate": [line["learning rate"] for line in lines],
            "validation_loss": [loss for _, _, loss, _ in validation_lines(output)]}


def test_losses_match_the_golden_file(preprocessed_corpus):
    measured = _measure(preprocessed_corpus)
    if os.environ.get(REGENERATE_ENV):
        os.makedirs(os.path.dirname(GOLDEN_FILE), exist_ok=True)
        with open(GOLDEN_FILE, "w") as f:
            json.dump(measured, f, indent=2)
            f.write("\n")
        pytest.skip(f"{REGENERATE_ENV} set: wrote {GOLDEN_FILE}")
    with open(GOLDEN_FILE) as f:
        golden = json.load(f)
    assert golden["flags"] == GOLDEN_FLAGS, "the golden configuration changed: regenerate the file"
    assert len(measured["lm_loss"]) == 8
    assert measured["lm_loss"] == pytest.approx(golden["lm_loss"], rel=1e-5)
    assert measured["grad_norm"] == pytest.approx(golden["grad_norm"], abs=2e-3)
    assert measured["learning_rate"] == pytest.approx(golden["learning_rate"], rel=1e-6)
    assert measured["validation_loss"] == pytest.approx(golden["validation_loss"], rel=1e-5)
