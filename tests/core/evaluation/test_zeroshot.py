"""megatron/core/evaluation/zeroshot.py on a tiny random GPTModel and the session's 4k-token BPE.

The figures are recomputed here without the windows or the samples: each target's log-probability
comes from one forward over exactly the context the windowing promises it (the whole text before
it for the first seq_length targets, then the tokens from the start of its window), and a LAMBADA
example is the argmax check over its own unpadded tokens.
"""
import json
import math

import pytest
import torch

from megatron.core.evaluation.detokenizer import wikitext_detokenize
from megatron.core.evaluation.zeroshot import (ACCURACY, LOSS, AccuracyReport, EvaluationInputError, LambadaExamples,
                                               LanguageModelWindows, evaluate_samples, lambada_split,
                                               perplexity_report, read_lambada, read_wikitext)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core.tokenizer import GPT2BPETokenizer
from tests.core.models.gpt.gpt_test_utils import randomize_parameters, tiny_config

SEQ_LENGTH = 16
WIKITEXT = (" = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : "
            "戦場のヴァルキュリア3 ) is a tactical role @-@ playing video game , released in 2011 . It sold "
            "1 @,@ 000 copies at 3 @.@ 5 times the cost of the \" first \" game 's release . \n = = Gameplay = = \n"
            " The game 's battle system is called the BliTZ system ; players take turns . \n")


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer_files):
    return GPT2BPETokenizer(*gpt2_tokenizer_files)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    model = GPTModel(tiny_config(padded_vocab_size=tokenizer.vocab_size, seq_length=SEQ_LENGTH,
                                 max_position_embeddings=SEQ_LENGTH), single_rank_groups())
    randomize_parameters(model, seed=1)
    return model.eval()


def next_token_log_prob(model, context: list[int], target: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([context]))[0, -1].double()
    return float(torch.log_softmax(logits, dim=-1)[target])


def test_wikitext_detokenizer_undoes_the_token_spacing():
    assert wikitext_detokenize(WIKITEXT).startswith(" = Valkyria Chronicles III =\n\nSenjō no Valkyria 3: "
                                                    "Unrecorded Chronicles (Japanese: 戦場のヴァルキュリア3) is a "
                                                    "tactical role-playing video game, released in 2011. It sold "
                                                    "1,000 copies at 3.5 times the cost of the \"first\" game's")
    assert "\n== Gameplay ==\n" in wikitext_detokenize(WIKITEXT)


@pytest.mark.parametrize("overlap", [None, 5, 1])
def test_windows_score_every_target_once(overlap):
    windows = LanguageModelWindows(list(range(40)), seq_length=8, pad_id=-1, overlapping_eval=overlap,
                                   num_original_words=10)
    scored = []
    for index in range(len(windows)):
        sample = windows[index]
        assert len(sample.tokens) == 9 and len(sample.loss_mask) == 8
        scored += [label for label, flag in zip(sample.tokens[1:], sample.loss_mask) if flag]
    assert scored == list(range(1, 40))


@pytest.mark.parametrize("overlap", [SEQ_LENGTH, 5])
def test_perplexity_equals_the_per_target_computation(tmp_path, tokenizer, model, overlap):
    path = tmp_path / "wiki.test.tokens"
    path.write_text(WIKITEXT, encoding="utf-8")
    windows = read_wikitext(str(path), tokenizer, SEQ_LENGTH, overlap)
    tokens = tokenizer.tokenize(wikitext_detokenize(WIKITEXT))
    assert windows.tokens == tokens and len(tokens) > 3 * SEQ_LENGTH
    total = evaluate_samples(model, windows, micro_batch_size=3, metric=LOSS)

    expected = 0.0
    for target in range(1, len(tokens)):
        window = 0 if target <= SEQ_LENGTH else math.ceil((target - SEQ_LENGTH) / overlap)
        expected -= next_token_log_prob(model, tokens[window * overlap:target], tokens[target])
    assert total == pytest.approx(expected, rel=1e-6)

    report = perplexity_report(total, windows)
    words = len(WIKITEXT.strip().split(" "))
    loss = expected / (len(tokens) - 1)
    assert report.avg_loss == pytest.approx(loss, rel=1e-6)
    assert report.ppl == pytest.approx(math.exp(loss), rel=1e-6)
    assert report.token_ratio == (len(tokens) - 1) / (words - 1)
    assert report.adjusted_ppl == pytest.approx(math.exp(loss * (len(tokens) - 1) / (words - 1)), rel=1e-6)
    assert "adjusted ppl: " in report.line("WIKITEXT103")


def test_lambada_accuracy_equals_the_argmax_check(tokenizer, model):
    """Half the examples end with the model's own greedy continuation (1 or 2 tokens), so both
    outcomes occur; one context is longer than the model and keeps its last tokens."""
    generator = torch.Generator().manual_seed(3)
    contexts, targets = [], []
    for index in range(8):
        context = torch.randint(0, tokenizer.vocab_size - 1, (5 + 3 * index,), generator=generator).tolist()
        target, length = [], 1 + index % 2
        for _ in range(length):
            visible = context[-(SEQ_LENGTH + 1 - length):] + target  # what the example's input will hold
            with torch.no_grad():
                target.append(int(model(torch.tensor([visible]))[0, -1].argmax()))
        if index % 4 >= 2:
            target[-1] = (target[-1] + 1) % tokenizer.vocab_size
        contexts.append(context)
        targets.append(target)
    examples = LambadaExamples(contexts, targets, SEQ_LENGTH, tokenizer.eod)

    correct = evaluate_samples(model, examples, micro_batch_size=3, metric=ACCURACY)
    expected = 0
    for context, target in zip(contexts, targets):
        tokens = (context + target)[-(SEQ_LENGTH + 1):]
        with torch.no_grad():
            predicted = model(torch.tensor([tokens[:-1]]))[0].argmax(dim=-1).tolist()
        expected += predicted[-len(target):] == target
    assert correct == expected == 4
    assert AccuracyReport(int(correct), len(examples)).accuracy == 0.5


def test_lambada_targets_plain_and_strict(tmp_path, tokenizer):
    text = "He handed her the lantern and said goodnight to Marguerite"
    context, target = lambada_split(text, tokenizer, strict=False)
    assert context + target == tokenizer.tokenize(text) and len(target) == 1
    context, target = lambada_split(text, tokenizer, strict=True)
    assert context == tokenizer.tokenize("He handed her the lantern and said goodnight to")
    assert target == tokenizer.tokenize(" Marguerite") and len(target) > 1

    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n\n" + json.dumps({"text": "one two"}) + "\n")
    examples = read_lambada(str(path), tokenizer, 64, strict=True)
    assert len(examples) == 2 and examples.targets[0] == target
    sample = examples[0]
    assert sum(sample.loss_mask) == len(target)
    assert sample.tokens[:len(context) + len(target)] == context + target


def test_bad_inputs_are_named(tmp_path, tokenizer):
    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "a fine line"}) + "\n" + json.dumps({"passage": "x y"}) + "\n")
    with pytest.raises(EvaluationInputError, match=r"lambada.jsonl, line 2: expected a JSON object"):
        read_lambada(str(path), tokenizer, SEQ_LENGTH, strict=False)
    with pytest.raises(EvaluationInputError, match="--valid-data .*missing.txt: No such file"):
        read_wikitext(str(tmp_path / "missing.txt"), tokenizer, SEQ_LENGTH, None)
    with pytest.raises(EvaluationInputError, match="--overlapping-eval 17: .* between 1 and --seq-length"):
        LanguageModelWindows(list(range(40)), SEQ_LENGTH, 0, 17, 10)


class _WithBos:
    """The GPT-2 tokenizer given a BOS (id 1), as a Llama tokenizer has one."""

    bos = 1

    def __init__(self, tokenizer):
        self.tokenize, self.eod = tokenizer.tokenize, tokenizer.eod


def test_a_tokenizer_with_bos_starts_every_text_with_it(tmp_path, tokenizer):
    llama_like = _WithBos(tokenizer)
    text = "He handed her the lantern and said goodnight to Marguerite"
    for strict in (False, True):
        context, target = lambada_split(text, llama_like, strict)
        plain_context, plain_target = lambada_split(text, tokenizer, strict)
        assert (context, target) == ([1] + plain_context, plain_target)
    path = tmp_path / "wiki.tokens"
    path.write_text(" = Title = \n the first line , with words . \n")
    windows, plain = read_wikitext(str(path), llama_like, 8, None), read_wikitext(str(path), tokenizer, 8, None)
    # the BOS is context only: one more target than without it, every text token scored
    assert windows.num_tokenized_tokens == plain.num_tokenized_tokens + 1
    assert windows[0].tokens[0] == 1
