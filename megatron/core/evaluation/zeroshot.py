"""WikiText-103 perplexity and LAMBADA cloze accuracy, Megatron's zero-shot tasks.

Every sample is ``seq_length + 1`` tokens and a mask over the ``seq_length`` predicted positions:
the model reads ``tokens[:-1]`` and position i is scored against ``tokens[i + 1]`` where the mask
is 1. Short samples are padded with the end-of-document id, masked out.

Perplexity (``LanguageModelWindows``): the tokenized text, T + 1 tokens (T targets), is cut into
windows of ``seq_length`` predictions starting every ``o`` tokens (``--overlapping-eval o``). The
first window scores all its positions; each later one only its last o, so every target is scored
exactly once and, when o < seq_length, with at least seq_length - o tokens of context. With the
summed cross entropy L over the padded vocabulary (the classes the model was trained on):

    loss = L / T                 ppl = exp(min(20, loss))
    token_ratio = T / (W - 1)    adjusted ppl = exp(min(20, loss · token_ratio))

where W is the number of space-separated words of the original file: the adjusted perplexity is
per word, comparable across tokenizers.

Cloze accuracy (``LambadaExamples``): the context predicts the last word; an example is correct
when the greedy (argmax) prediction equals the target at every scored position. By default the
target is the text's last token; with ``strict`` it is every token of the last word, tokenized with
its leading space apart from the context.

A tokenizer with a BOS (Llama's) starts the text (perplexity) and each passage (cloze) with it, as
preprocessing starts every training document: the BOS is context, never a target.
"""
import json
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from megatron.core.evaluation.detokenizer import wikitext_detokenize
from megatron.core.tokenizer import with_bos

LogitsFunction = Callable[[torch.Tensor], torch.Tensor]
LOSS, ACCURACY = "loss", "accuracy"
_EXPONENT_CAP = 20


class EvaluationInputError(ValueError):
    """An evaluation file or setting that cannot be used; the message names it."""


@dataclass(frozen=True)
class Sample:
    """tokens: ``seq_length + 1`` ids; loss_mask: ``seq_length`` flags (1 = scored)."""

    tokens: list[int]
    loss_mask: list[int]


def padded_sample(tokens: Sequence[int], loss_mask: Sequence[int], seq_length: int, pad_id: int) -> Sample:
    """``tokens`` (at most seq_length + 1) padded with ``pad_id``; ``loss_mask`` covers ``tokens[1:]``
    and is extended with zeros."""
    missing = seq_length + 1 - len(tokens)
    return Sample(list(tokens) + [pad_id] * missing, list(loss_mask) + [0] * missing)


class LanguageModelWindows:
    """The windows of a tokenized text for perplexity (see the module docstring).

    Args:
        tokens: the whole text's ids (T + 1 of them).
        seq_length: predictions per window.
        pad_id: the id that fills the last window.
        overlapping_eval: o, the stride between windows, 1 <= o <= seq_length; None means seq_length
            (no overlap).
        num_original_words: W, for the token-to-word adjustment.
    """

    def __init__(self, tokens: Sequence[int], seq_length: int, pad_id: int, overlapping_eval: int | None,
                 num_original_words: int):
        stride = seq_length if overlapping_eval is None else overlapping_eval
        if not 1 <= stride <= seq_length:
            raise EvaluationInputError(f"--overlapping-eval {overlapping_eval}: the stride between windows must "
                                       f"be between 1 and --seq-length ({seq_length})")
        if len(tokens) < 2:
            raise EvaluationInputError("the text has fewer than 2 tokens: nothing to predict")
        self.tokens = list(tokens)
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.stride = stride
        self.num_original_words = num_original_words
        targets = len(self.tokens) - 1
        self.num_windows = math.ceil(max(targets - stride, 0) / stride) + 1

    @property
    def num_tokenized_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.num_windows:
            raise IndexError(index)
        start = index * self.stride
        window = self.tokens[start:start + self.seq_length + 1]
        scored = len(window) - 1
        if index > 0:
            unscored = min(self.seq_length - self.stride, scored)  # context the previous window scored
            mask = [0] * unscored + [1] * (scored - unscored)
        else:
            mask = [1] * scored
        return padded_sample(window, mask, self.seq_length, self.pad_id)


class LambadaExamples:
    """LAMBADA examples as samples (see the module docstring); contexts longer than the model's
    ``seq_length`` keep their last tokens."""

    def __init__(self, contexts: list[list[int]], targets: list[list[int]], seq_length: int, pad_id: int):
        self.contexts = contexts
        self.targets = targets
        self.seq_length = seq_length
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> Sample:
        context, target = self.contexts[index], self.targets[index]
        tokens = (context + target)[-(self.seq_length + 1):]
        mask = [0] * (len(tokens) - 1 - len(target)) + [1] * len(target)
        return padded_sample(tokens, mask, self.seq_length, self.pad_id)


def read_text(path: str, flag: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except OSError as exc:
        raise EvaluationInputError(f"{flag} {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise EvaluationInputError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from exc


def read_wikitext(path: str, tokenizer, seq_length: int, overlapping_eval: int | None,
                  flag: str = "--valid-data") -> LanguageModelWindows:
    """WikiText-103 (a raw ``wiki.test.tokens``-style file): W counted on the file as it is, then the
    text detokenized and tokenized whole."""
    text = read_text(path, flag)
    num_original_words = len(text.strip().split(" "))
    if num_original_words < 2:
        raise EvaluationInputError(f"{flag} {path}: fewer than 2 words")
    tokens = with_bos(tokenizer, tokenizer.tokenize(wikitext_detokenize(text)))
    return LanguageModelWindows(tokens, seq_length, tokenizer.eod, overlapping_eval, num_original_words)


def lambada_split(text: str, tokenizer, strict: bool) -> tuple[list[int], list[int]]:
    """(context ids, target ids) of one LAMBADA passage; the context starts with the tokenizer's BOS
    where it has one."""
    if not strict:
        tokens = with_bos(tokenizer, tokenizer.tokenize(text))
        return tokens[:-1], tokens[-1:]
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    return with_bos(tokenizer, tokenizer.tokenize(text[:start].strip())), tokenizer.tokenize(" " + last_word)


def read_lambada(path: str, tokenizer, seq_length: int, strict: bool,
                 flag: str = "--valid-data") -> LambadaExamples:
    """LAMBADA as jsonl, one ``{"text": passage}`` a line (blank lines skipped)."""
    contexts, targets = [], []
    for number, line in enumerate(read_text(path, flag).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise EvaluationInputError(f"{flag} {path}, line {number}: expected a JSON object with a "
                                       f"\"text\" string ({type(exc).__name__})") from exc
        if not isinstance(text, str) or len(text.split()) < 2:
            raise EvaluationInputError(f"{flag} {path}, line {number}: \"text\" needs at least two words")
        context, target = lambada_split(text, tokenizer, strict)
        if not context or not target:
            raise EvaluationInputError(f"{flag} {path}, line {number}: tokenizes to no context or no target")
        contexts.append(context)
        targets.append(target)
    if not targets:
        raise EvaluationInputError(f"{flag} {path}: no example")
    return LambadaExamples(contexts, targets, seq_length, tokenizer.eod)


def batch_tensors(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs [b, s], labels [b, s], loss_mask [b, s] float) of ``samples``."""
    tokens = torch.tensor([sample.tokens for sample in samples], dtype=torch.long)  # [b, s + 1]
    mask = torch.tensor([sample.loss_mask for sample in samples], dtype=torch.float32)
    return tokens[:, :-1], tokens[:, 1:], mask


def masked_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """Σ cross_entropy(logits, labels) over the positions where ``loss_mask`` is 1 (fp32 softmax)."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")  # [b·s]
    return float((losses.double() * loss_mask.flatten().double()).sum())


def cloze_correct(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> int:
    """Samples whose argmax equals the label at every scored position."""
    hits = (logits.argmax(dim=-1) == labels) | (loss_mask == 0)  # [b, s]
    return int(hits.all(dim=-1).sum())


def evaluate_samples(logits_fn: LogitsFunction, samples, micro_batch_size: int, metric: str,
                     indices: Sequence[int] | None = None) -> float:
    """The summed loss (``metric`` "loss") or the number of correct examples ("accuracy") over
    ``samples[i]`` for i in ``indices`` (default: all), ``micro_batch_size`` samples a forward."""
    score = masked_loss_sum if metric == LOSS else cloze_correct
    indices = range(len(samples)) if indices is None else indices
    total = 0.0
    for start in range(0, len(indices), micro_batch_size):
        inputs, labels, mask = batch_tensors([samples[i] for i in indices[start:start + micro_batch_size]])
        with torch.no_grad():
            total += score(logits_fn(inputs), labels, mask)
    return total


@dataclass(frozen=True)
class PerplexityReport:
    avg_loss: float
    ppl: float
    adjusted_ppl: float
    token_ratio: float

    def line(self, task: str) -> str:
        return (f" validation results on {task} | avg loss: {self.avg_loss:.4E} | ppl: {self.ppl:.4E} | "
                f"adjusted ppl: {self.adjusted_ppl:.4E} | token ratio: {self.token_ratio} |")


def perplexity_report(loss_sum: float, windows: LanguageModelWindows) -> PerplexityReport:
    """The module docstring's formulas from the summed loss over all windows."""
    targets = windows.num_tokenized_tokens - 1
    avg_loss = loss_sum / targets
    token_ratio = targets / (windows.num_original_words - 1)
    return PerplexityReport(avg_loss, math.exp(min(_EXPONENT_CAP, avg_loss)),
                            math.exp(min(_EXPONENT_CAP, avg_loss * token_ratio)), token_ratio)


@dataclass(frozen=True)
class AccuracyReport:
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total

    def line(self, task: str) -> str:
        return (f" validation results on {task} | number correct: {self.correct:.4E} | "
                f"total examples: {self.total:.4E} | avg accuracy: {self.accuracy:.4E}")
