"""tasks/main.py on the session's trained TP=2 x PP=2 checkpoint (trained_checkpoint.py).

WikiText-103 perplexity and LAMBADA accuracy (plain and strict) of the checkpoint's model, run whole
in this process, equal the figures recomputed here from its logits without the windows or the
samples (one forward per target over the context the windowing promises it; the argmax check of
each passage on its own tokens). Half the LAMBADA passages end with the model's greedy next word,
so both outcomes occur.
"""
import argparse
import gzip
import json
import math

import pytest
import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.evaluation.detokenizer import wikitext_detokenize
from megatron.core.tokenizer import GPT2BPETokenizer
from tasks.main import evaluate_task, main
from tests.conftest import SAMPLE_CORPUS
from tests.core.evaluation.test_zeroshot import WIKITEXT, next_token_log_prob
from tests.tasks.trained_checkpoint import SEQ_LENGTH, checkpoint_path, trained  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
OVERLAP = 8


def task_flags(task: str, path: str, strict: bool = False) -> argparse.Namespace:
    return argparse.Namespace(task=task, valid_data=[path], overlapping_eval=OVERLAP, strict_lambada=strict,
                              micro_batch_size=3)


def corpus_contexts(count: int, words: int = 10) -> list[str]:
    with gzip.open(SAMPLE_CORPUS, "rt") as f:
        text = " ".join(json.loads(line)["text"] for _, line in zip(range(40), f))
    pieces = [word for word in text.split() if word.isascii()]
    return [" ".join(pieces[index * words:(index + 1) * words]) for index in range(count)]


def lambada_passages(model, tokenizer) -> list[str]:
    """Passages ending with a whole word: the model's greedy next token where that is one (every
    other passage), another common word otherwise."""
    passages = []
    for index, context in enumerate(corpus_contexts(40)):
        tokens = tokenizer.tokenize(context)
        with torch.no_grad():
            greedy = tokenizer.detokenize([int(model(torch.tensor([tokens]))[0, -1, :tokenizer.vocab_size].argmax())])
        ending = greedy if greedy.startswith(" ") and greedy[1:].isalpha() and index % 2 == 0 else None
        ending = ending or (" the" if greedy != " the" else " of")
        if tokenizer.tokenize(context + ending) == tokens + tokenizer.tokenize(ending):
            passages.append(context + ending)
    return passages


def expected_lambada(model, tokenizer, passages: list[str], strict: bool) -> int:
    correct = 0
    for text in passages:
        if strict:
            last_word = text.split()[-1]
            context = tokenizer.tokenize(text[:text.rfind(last_word)].strip())
            target = tokenizer.tokenize(" " + last_word)
        else:
            tokens = tokenizer.tokenize(text)
            context, target = tokens[:-1], tokens[-1:]
        tokens = (context + target)[-(SEQ_LENGTH + 1):]
        with torch.no_grad():
            predicted = model(torch.tensor([tokens[:-1]]))[0].argmax(dim=-1).tolist()
        correct += predicted[-len(target):] == target
    return correct


def expected_wikitext_loss(model, tokenizer) -> float:
    tokens = tokenizer.tokenize(wikitext_detokenize(WIKITEXT))
    total = 0.0
    for target in range(1, len(tokens)):
        window = 0 if target <= SEQ_LENGTH else math.ceil((target - SEQ_LENGTH) / OVERLAP)
        total -= next_token_log_prob(model, tokens[window * OVERLAP:target], tokens[target])
    return total / (len(tokens) - 1)


@pytest.fixture(scope="module")
def files(trained, tmp_path_factory):  # noqa: F811
    """(the checkpoint's model run whole, its tokenizer, {task file name: path})."""
    data, save = trained
    model = load_gpt_model(open_checkpoint(checkpoint_path(save)))
    tokenizer = GPT2BPETokenizer(data.vocab_file, data.merge_file)
    directory = tmp_path_factory.mktemp("task_files")
    (directory / "wiki.test.tokens").write_text(WIKITEXT, encoding="utf-8")
    passages = lambada_passages(model, tokenizer)
    (directory / "lambada.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in passages))
    return model, tokenizer, passages, {name: str(directory / name) for name in ("wiki.test.tokens", "lambada.jsonl")}


def test_figures_equal_the_recomputation_from_logits(files):
    model, tokenizer, passages, paths = files
    report = evaluate_task(task_flags("WIKITEXT103", paths["wiki.test.tokens"]), model, tokenizer, SEQ_LENGTH)
    assert report.avg_loss == pytest.approx(expected_wikitext_loss(model, tokenizer), rel=1e-6)
    words = len(WIKITEXT.strip().split(" "))
    assert report.token_ratio == (len(tokenizer.tokenize(wikitext_detokenize(WIKITEXT))) - 1) / (words - 1)
    assert report.adjusted_ppl == pytest.approx(math.exp(report.avg_loss * report.token_ratio), rel=1e-9)
    for strict in (False, True):
        accuracy = evaluate_task(task_flags("LAMBADA", paths["lambada.jsonl"], strict), model, tokenizer, SEQ_LENGTH)
        expected = expected_lambada(model, tokenizer, passages, strict)
        assert (accuracy.correct, accuracy.total) == (expected, len(passages))
        assert 0 < expected < len(passages)


def test_command_line_prints_the_figures_and_names_bad_flags(trained, files, capsys, monkeypatch):  # noqa: F811
    data, save = trained
    model, tokenizer, _, paths = files
    common = ["--load", save, "--no-load-optim", "--no-load-rng", "--micro-batch-size", "3", "--vocab-file",
              data.vocab_file, "--merge-file", data.merge_file, "--num-layers", "2", "--seq-length", str(SEQ_LENGTH)]
    for task, path, extra in (("WIKITEXT103", paths["wiki.test.tokens"], ["--overlapping-eval", str(OVERLAP)]),
                              ("LAMBADA", paths["lambada.jsonl"], ["--strict-lambada"])):
        assert main(["--task", task, "--valid-data", path, *common, *extra]) == 0
        expected = evaluate_task(task_flags(task, path, strict=True), model, tokenizer, SEQ_LENGTH).line(task)
        assert capsys.readouterr().out.strip() == expected.strip()
    assert main(["--task", "LAMBADA", "--valid-data", paths["lambada.jsonl"], *common, "--hidden-size", "32"]) == 2
    assert "--hidden-size 32: the checkpoint at --load" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--task", "LAMBADA", "--valid-data", paths["lambada.jsonl"], *common]) == 2
    assert "launch the evaluation as one process" in capsys.readouterr().err
