"""Our model as an lm-evaluation-harness language model (``lm_eval.api.model.TemplateLM``).

The harness asks three kinds of questions; each is answered from ``logits_fn(tokens [b, s]) ->
logits [b, s, V_padded]``, the same call on every rank of a TP/PP run (every rank asks the same
questions in the same order, so the model's collectives line up):

- loglikelihood(context, continuation): log p(continuation | context) summed over its tokens, and
  whether greedy decoding would produce it. The pair is tokenized as the harness's Hugging Face
  model does it (the harness's ``_encode_pair``: the whole text, then the context's length; an
  empty context becomes the end-of-document token), the input keeps its last ``max_length``
  tokens, batches are padded on the right (causal attention makes the padding invisible).
- loglikelihood_rolling(text): the text's log-likelihood in the harness's disjoint rolling windows
  of ``max_length`` tokens, each document on its own, the first window after the end-of-document
  token.
- generate_until(context, {until, max_gen_toks}): greedy decoding, the context keeping its last
  ``max_length - max_gen_toks`` tokens, stopped at the end-of-document token, at a stop string or
  after ``max_gen_toks`` tokens; the text is cut before the first stop string.

Probabilities are a softmax over the tokenizer's vocabulary: the padding rows of the output layer
are dropped, as in the exported Hugging Face model (Megatron's WikiText and LAMBADA tasks keep
them; see docs/evaluation.md).
"""
from typing import Callable

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

DEFAULT_MAX_GEN_TOKS = 256


class MegatronLM(TemplateLM):
    """Args:
        logits_fn: the model (see the module docstring).
        tokenizer: ours (``tokenize``, ``detokenize``, ``eod``, ``vocab_size``).
        max_length: the longest input the model takes (its training sequence length).
        batch_size: inputs per forward for the loglikelihood requests.
        adaptive_seq_len: pad each batch to its longest input instead of ``max_length``.
        rank: this process's global rank; only rank 0 shows progress bars.
    """

    def __init__(self, logits_fn: Callable[[torch.Tensor], torch.Tensor], tokenizer, max_length: int,
                 batch_size: int = 1, adaptive_seq_len: bool = False, rank: int = 0):
        super().__init__()
        self.logits_fn = logits_fn
        self.megatron_tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.adaptive_seq_len = adaptive_seq_len
        self.global_rank = rank

    @property
    def eot_token_id(self) -> int:
        return self.megatron_tokenizer.eod

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.megatron_tokenizer.tokenize(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.megatron_tokenizer.detokenize(tokens)

    def log_probs(self, inputs: list[list[int]]) -> torch.Tensor:
        """log_softmax over the tokenizer's vocabulary of the model's logits, [b, s, V] fp32, for
        ``inputs`` padded on the right with the end-of-document id."""
        width = max(map(len, inputs)) if self.adaptive_seq_len else self.max_length
        tokens = torch.full((len(inputs), width), self.eot_token_id, dtype=torch.long)  # [b, s]
        for row, ids in enumerate(inputs):
            tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        with torch.no_grad():
            logits = self.logits_fn(tokens)[..., :self.megatron_tokenizer.vocab_size]
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability, is greedy) of each ``(key, context ids, continuation ids)``."""
        results = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in chunk]
            log_probs = self.log_probs(inputs)
            for (key, _, continuation), ids, row in zip(chunk, inputs, log_probs):
                positions = row[len(ids) - len(continuation):len(ids)]  # [c, V]: those predicting the continuation
                targets = torch.tensor(continuation, dtype=torch.long)
                answer = (float(positions.gather(1, targets[:, None]).sum()),
                          bool((positions.argmax(dim=-1) == targets).all()))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                results.append(answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (text,) in (request.args for request in requests):
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.eot_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, context, continuation) for context, continuation in windows])
            total = sum(score for score, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    def greedy_continuation(self, context: list[int], max_new_tokens: int, stop: list[str]) -> list[int]:
        """Up to ``max_new_tokens`` greedy tokens after ``context`` (the whole sequence recomputed
        each step), ending early at the end-of-document token or once a stop string appears."""
        generated = []
        for _ in range(max_new_tokens):
            next_token = int(self.log_probs([context + generated])[0, len(context) + len(generated) - 1].argmax())
            generated.append(next_token)
            if next_token == self.eot_token_id or any(s and s in self.tok_decode(generated) for s in stop):
                break
        return generated

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id])
        texts = []
        for context, gen_kwargs in (request.args for request in requests):
            options = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            if options.get("do_sample"):
                raise ValueError(f"generate_until with do_sample: this adapter decodes greedily only ({gen_kwargs})")
            stop = handle_stop_sequences(options.get("until"), eos=eos)
            max_new_tokens = options["max_gen_toks"]
            if max_new_tokens >= self.max_length:
                raise ValueError(f"max_gen_toks {max_new_tokens} leaves no room for a context in "
                                 f"{self.max_length} tokens")
            tokens = self.tok_encode(context)[-(self.max_length - max_new_tokens):]
            text = postprocess_generated_text(self.tok_decode(self.greedy_continuation(tokens, max_new_tokens, stop)),
                                              stop=stop, think_end_token=None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            texts.append(text)
        return texts
