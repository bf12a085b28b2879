"""Our model as an lm-evaluation-harness language model (``lm_eval.api.model.TemplateLM``).

The harness asks three kinds of questions; each is answered from the model of one replica split
over its TP x PP ranks (``PipelineForward``: every rank of the replica asks the same questions in
the same order, so the model's collectives line up):

- loglikelihood(context, continuation): log p(continuation | context) summed over its tokens, and
  whether greedy decoding would produce it. The pair is tokenized as the harness's Hugging Face
  model does it (the harness's ``_encode_pair``: the whole text, then the context's length; an
  empty context becomes the end-of-document token), the input keeps its last ``max_length``
  tokens, batches are padded on the right (causal attention makes the padding invisible).
- loglikelihood_rolling(text): the text's log-likelihood in the harness's disjoint rolling windows
  of ``max_length`` tokens, each document on its own, the first window after the end-of-document
  token.
- generate_until(context, {until, max_gen_toks}): greedy decoding with the key/value cache
  (megatron.core.text_generation), the context keeping its last ``max_length - max_gen_toks``
  tokens, up to ``max_gen_toks`` tokens or the end-of-document token; the text is cut before the
  first stop string.

Probabilities are a softmax over the tokenizer's vocabulary: the padding rows of the output layer
are dropped, as in the exported Hugging Face model (Megatron's WikiText and LAMBADA tasks keep
them; see docs/evaluation.md).

Data-parallel replicas (``Replicas``) split the work: the requests go in batches, replica r answers
batches r, r + n, ... and the replicas share their answers, so each returns every answer.
"""
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.core.text_generation.forward import PipelineForward
from megatron.core.text_generation.generation import generate
from megatron.core.text_generation.sampling import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256
GREEDY = SamplingParams(greedy=True)


@dataclass(frozen=True)
class Replicas:
    """This process's data-parallel replica ``rank`` of ``size``; ``gather(value)`` -> every
    replica's ``value`` in replica order (collective over the replicas; one replica: ``[value]``)."""

    rank: int = 0
    size: int = 1
    gather: Callable[[object], list] = lambda value: [value]


class MegatronLM(TemplateLM):
    """Args:
        model: the replica's model (see the module docstring).
        tokenizer: ours (``tokenize``, ``detokenize``, ``eod``, ``vocab_size``).
        max_length: the longest input the model takes (its --seq-length).
        batch_size: inputs per forward (loglikelihood) or per generation batch.
        adaptive_seq_len: pad each batch to its longest input instead of ``max_length``.
        device: where the token tensors go (the model's device).
        replicas: the data-parallel replicas sharing the requests.
    """

    def __init__(self, model: PipelineForward, tokenizer, max_length: int, batch_size: int = 1,
                 adaptive_seq_len: bool = False, device: torch.device | None = None, replicas: Replicas = Replicas()):
        super().__init__()
        self.model = model
        self.megatron_tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.adaptive_seq_len = adaptive_seq_len
        self.model_device = device
        self.replicas = replicas

    @property
    def eot_token_id(self) -> int:
        return self.megatron_tokenizer.eod

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.megatron_tokenizer.tokenize(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.megatron_tokenizer.detokenize(tokens)

    def answer_batches(self, batches: Sequence[list], answer: Callable[[list], list]) -> list:
        """``answer(batch)`` of every batch, concatenated in order; this replica computes its share."""
        rank, size = self.replicas.rank, self.replicas.size
        answered = self.replicas.gather([answer(batch) for batch in batches[rank::size]])  # [replica][its batch]
        return [item for index in range(len(batches)) for item in answered[index % size][index // size]]

    def log_probs(self, inputs: list[list[int]]) -> torch.Tensor:
        """log_softmax over the tokenizer's vocabulary of the model's logits, [b, s, V] fp32 on the
        model's device, for ``inputs`` padded on the right with the end-of-document id."""
        width = max(map(len, inputs)) if self.adaptive_seq_len else self.max_length
        tokens = torch.full((len(inputs), width), self.eot_token_id, dtype=torch.long)  # [b, s]
        for row, ids in enumerate(inputs):
            tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        logits = self.model.logits(tokens.to(self.model_device))[..., :self.megatron_tokenizer.vocab_size]
        return F.log_softmax(logits.float(), dim=-1)

    def score_batch(self, chunk: list) -> list[tuple[float, bool]]:
        """(log-probability, is greedy) of each ``(key, context ids, continuation ids)`` of one forward."""
        inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in chunk]
        answers = []
        for (_, _, continuation), ids, row in zip(chunk, inputs, self.log_probs(inputs)):
            positions = row[len(ids) - len(continuation):len(ids)]  # [c, V]: those predicting the continuation
            targets = torch.tensor(continuation, dtype=torch.long, device=row.device)
            answers.append((float(positions.gather(1, targets[:, None]).sum()),
                            bool((positions.argmax(dim=-1) == targets).all())))
        return answers

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        batches = [requests[start:start + self.batch_size] for start in range(0, len(requests), self.batch_size)]
        answers = self.answer_batches(batches, self.score_batch)
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [request.args[0] for request in requests]
        windows = [[make_disjoint_window(window) for window in get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.eot_token_id, max_seq_len=self.max_length,
            context_len=1)] for text in texts]
        scores = iter(self._loglikelihood_tokens([(None, context, continuation) for document in windows
                                                  for context, continuation in document]))
        totals = [sum(score for score, _ in (next(scores) for _ in document)) for document in windows]
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def greedy_continuations(self, batch: list[tuple[list[int], int]]) -> list[list[int]]:
        """The greedy new tokens of each ``(context ids, max new tokens)`` of a batch sharing the limit
        (the end-of-document token included where generation stopped there)."""
        contexts = [context for context, _ in batch]
        output = generate(self.model, contexts, batch[0][1], GREEDY, eod=self.eot_token_id,
                          vocab_size=self.megatron_tokenizer.vocab_size, max_length=self.max_length,
                          device=self.model_device)
        return [output.continuation(row) for row in range(len(contexts))]

    def generation_batches(self, requests) -> tuple[list[list], list[list[str]]]:
        """The (context ids, max new tokens) of every request, in batches sharing one limit; and the
        stop strings of each request."""
        eos = self.tok_decode([self.eot_token_id])
        prompts, stops = [], []
        for context, gen_kwargs in (request.args for request in requests):
            options = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            if options.get("do_sample"):
                raise ValueError(f"generate_until with do_sample: this adapter decodes greedily only ({gen_kwargs})")
            max_new_tokens = options["max_gen_toks"]
            if max_new_tokens >= self.max_length:
                raise ValueError(f"max_gen_toks {max_new_tokens} leaves no room for a context in "
                                 f"{self.max_length} tokens")
            tokens = self.tok_encode(context)[-(self.max_length - max_new_tokens):] or [self.eot_token_id]
            prompts.append((tokens, max_new_tokens))
            stops.append(handle_stop_sequences(options.get("until"), eos=eos))
        batches = []
        for start in range(len(prompts)):
            if not batches or len(batches[-1]) == self.batch_size or batches[-1][0][1] != prompts[start][1]:
                batches.append([])
            batches[-1].append(prompts[start])
        return batches, stops

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        batches, stops = self.generation_batches(requests)
        continuations = self.answer_batches(batches, self.greedy_continuations)
        texts = []
        for request, tokens, stop in zip(requests, continuations, stops):
            text = postprocess_generated_text(self.tok_decode(tokens), stop=stop, think_end_token=None)
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts
