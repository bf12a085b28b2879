"""PretrainedFromHF: a ``transformers`` tokenizer loaded offline from a local directory."""
from megatron.core.tokenizer.bpe_files import TokenizerError
from megatron.core.tokenizer.hf_tokenizer import PROBE_TEXT, leading_special_token

# transformers warns when a text is longer than the model's context; documents are always longer.
_NO_LENGTH_LIMIT = 1 << 62


class PretrainedFromHF:
    """``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``, as Megatron-DeepSpeed uses it.

    ``vocab_size = len(tokenizer)`` (added tokens included), ``eod = tokenizer.eos_token_id``;
    ``tokenize(text) = tokenizer.encode(text, add_special_tokens=False)``, and ``bos`` is the token
    ``tokenizer.encode`` puts in front (None if it puts none): callers put it before each document
    and prompt, so a document is the tokenizer's own ``encode(text)`` for Llama-style tokenizers
    (an EOS that a tokenizer would append is left to ``--append-eod``). Nothing is downloaded: a hub
    name that is not in the local cache, or a missing directory, raises TokenizerError.
    """

    def __init__(self, tokenizer_name_or_path, use_fast=None):
        self._arguments = (tokenizer_name_or_path, use_fast)
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise TokenizerError("--tokenizer-type PretrainedFromHF needs the transformers "
                                 "package (pip install transformers)") from err
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                tokenizer_name_or_path, local_files_only=True,
                use_fast=True if use_fast is None else bool(use_fast))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise TokenizerError(
                f"--tokenizer-name-or-path {tokenizer_name_or_path}: cannot load a tokenizer "
                f"offline (it must be a local directory with the tokenizer files, or a model "
                f"already in the Hugging Face cache; nothing is downloaded): {err}") from err
        if self.tokenizer.eos_token_id is None:
            raise TokenizerError(f"--tokenizer-name-or-path {tokenizer_name_or_path}: the "
                                 "tokenizer has no eos token, which is needed as eod")
        self.tokenizer.model_max_length = _NO_LENGTH_LIMIT
        self.eod = self.tokenizer.eos_token_id
        self.bos = leading_special_token(self.tokenizer.encode(PROBE_TEXT),
                                         self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
        self.vocab_size = len(self.tokenizer)
        self.vocab = self.tokenizer.get_vocab()
        self.inv_vocab = {token_id: token for token, token_id in self.vocab.items()}
        self.is_fast = bool(self.tokenizer.is_fast)
        self.fast_path_reason = ("transformers fast tokenizer" if self.is_fast
                                 else "transformers slow (Python) tokenizer")

    def __reduce__(self):
        return PretrainedFromHF, self._arguments

    def tokenize(self, text):
        """Token ids of ``text`` without special tokens: list[int]."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize_batch(self, texts):
        """``[tokenize(t) for t in texts]`` in one call to the tokenizer."""
        if not texts:
            return []
        return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def detokenize(self, ids):
        """Text of ``ids`` (``tokenizer.decode``)."""
        return self.tokenizer.decode([int(token_id) for token_id in ids])
