"""tasks/main.py on the session's trained TP=2 x PP=2 checkpoint (trained_checkpoint.py).

WikiText-103 perplexity and LAMBADA accuracy (plain and strict) of the checkpoint's model, run whole
in this process, equal the figures recomputed here from its logits without the windows or the
samples (one forward per target over the context the windowing promises it; the argmax check of
each passage on its own tokens). Half the LAMBADA passages end with the model's greedy next word,
so both outcomes occur. Launched on 4 gloo ranks (one process each) under the saved TP=2 x PP=2, the three
figures equal those of the one-process model (rel 1e-6); re-cut to TP=1 x PP=2 with two data-parallel
replicas, the command prints the one-process line once. Bad flags are named before any process group.
"""
import argparse
import dataclasses
import os
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
from tests.conftest import REPO_ROOT, SAMPLE_CORPUS
from tests.core.evaluation.test_zeroshot import WIKITEXT, next_token_log_prob
from tests.tasks.trained_checkpoint import SEQ_LENGTH, checkpoint_path, model_flags
from tests.training.e2e_utils import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
OVERLAP = 8
MAIN = os.path.join(REPO_ROOT, "tasks", "main.py")
WORKER = os.path.join(REPO_ROOT, "tests", "tasks", "evaluation_worker.py")


def task_arguments(task: str, paths: dict[str, str]) -> list[str]:
    path = paths["wiki.test.tokens" if task == "WIKITEXT103" else "lambada.jsonl"]
    return ["--task", task, "--valid-data", path, "--overlapping-eval", str(OVERLAP), "--micro-batch-size", "3"]


MICRO_BATCH = 3


def task_flags(task: str, path: str, strict: bool = False) -> argparse.Namespace:
    return argparse.Namespace(task=task, valid_data=[path], overlapping_eval=OVERLAP, strict_lambada=strict)


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
def files(trained, tmp_path_factory):
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
    report = evaluate_task(task_flags("WIKITEXT103", paths["wiki.test.tokens"]), MICRO_BATCH, model, tokenizer,
                           SEQ_LENGTH)
    assert report.avg_loss == pytest.approx(expected_wikitext_loss(model, tokenizer), rel=1e-6)
    words = len(WIKITEXT.strip().split(" "))
    assert report.token_ratio == (len(tokenizer.tokenize(wikitext_detokenize(WIKITEXT))) - 1) / (words - 1)
    assert report.adjusted_ppl == pytest.approx(math.exp(report.avg_loss * report.token_ratio), rel=1e-9)
    for strict in (False, True):
        accuracy = evaluate_task(task_flags("LAMBADA", paths["lambada.jsonl"], strict), MICRO_BATCH, model,
                                 tokenizer, SEQ_LENGTH)
        expected = expected_lambada(model, tokenizer, passages, strict)
        assert (accuracy.correct, accuracy.total) == (expected, len(passages))
        assert 0 < expected < len(passages)


def test_tp2_pp2_launch_equals_one_process(trained, files, tmp_path):
    """4 ranks under the saved layout (one replica): the figures of the model run whole in one process."""
    data, save = trained
    model, tokenizer, _, paths = files
    output = tmp_path / "figures.json"
    arguments = ["--load", save, *model_flags(data), *task_arguments("WIKITEXT103", paths),
                 "--lambada-data", paths["lambada.jsonl"], "--output", str(output)]
    run_ranks([WORKER, *arguments], 4, timeout=240).assert_ok()
    found = json.loads(output.read_text())
    for name, task, strict in (("WIKITEXT103", "WIKITEXT103", False), ("LAMBADA", "LAMBADA", False),
                               ("LAMBADA strict", "LAMBADA", True)):
        path = paths["wiki.test.tokens" if task == "WIKITEXT103" else "lambada.jsonl"]
        expected = dataclasses.asdict(evaluate_task(task_flags(task, path, strict), MICRO_BATCH, model, tokenizer,
                                                    SEQ_LENGTH))
        assert found[name] == pytest.approx(expected, rel=1e-6)
    print(found)


def test_command_line_under_data_parallel_replicas(trained, files):
    """tasks/main.py on 4 ranks re-cut to TP=1 x PP=2, two replicas sharing the windows: the last rank
    prints the line of the model run whole in one process."""
    data, save = trained
    model, tokenizer, _, paths = files
    layout = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    result = run_ranks([MAIN, "--load", save, "--no-load-optim", "--no-load-rng", *model_flags(data),
                        *task_arguments("WIKITEXT103", paths), *layout], 4, timeout=240)
    result.assert_ok()
    flags = task_flags("WIKITEXT103", paths["wiki.test.tokens"])
    expected = evaluate_task(flags, MICRO_BATCH, model, tokenizer, SEQ_LENGTH).line("WIKITEXT103")
    assert result.output.count(" validation results on WIKITEXT103") == 1
    assert expected in result.output


def test_bad_flags_are_named_before_starting(trained, files, capsys):
    data, save = trained
    _, _, _, paths = files
    common = ["--load", save, *model_flags(data), *task_arguments("LAMBADA", paths)]
    for extra, message in ((["--hidden-size", "32"], "--hidden-size 32: the checkpoint at --load"),
                           ([], "1 processes cannot hold TP 2 x PP 2"),
                           (["--task", "RACE"], "--task RACE: fine-tuning tasks are not built here")):
        with pytest.raises(SystemExit) as exit_status:
            main(common + extra)
        assert exit_status.value.code == 2
        assert message in capsys.readouterr().err
    assert not torch.distributed.is_initialized()
