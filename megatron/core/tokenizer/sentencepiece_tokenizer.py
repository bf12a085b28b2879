"""SentencePieceTokenizer: a SentencePiece ``.model`` file, through the optional ``sentencepiece`` package.

The GPT semantics of Megatron-LM's GPTSentencePieceTokenizer and Llama2Tokenizer (both names are
accepted): ``eod`` is the model's eos id, ``bos`` its bos id (None when the model was trained
without one), ``vocab_size`` its number of pieces; no token is added to the vocabulary.
``tokenize(text)`` is ``encode(text)`` (no BOS, no EOS); callers put ``bos`` before each document
and prompt, which gives Llama's ``encode(text, add_bos=True)``.
"""
import os

from megatron.core.tokenizer.bpe_files import TokenizerError

INSTALL_HINT = "pip install .[sentencepiece] (or pip install sentencepiece)"


def import_sentencepiece(tokenizer_type="SentencePieceTokenizer"):
    """The ``sentencepiece`` module, or TokenizerError naming the extra to install."""
    try:
        import sentencepiece
    except ImportError as err:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs the sentencepiece package: "
                             f"{INSTALL_HINT}") from err
    return sentencepiece


class SentencePieceTokenizer:
    """``sentencepiece.SentencePieceProcessor(model_file=model_file)``; see the module docstring.

    Raises TokenizerError naming --tokenizer-model and the file when it is missing, does not load,
    or the model has no eos piece (trained with ``eos_id=-1``).
    """

    def __init__(self, model_file, tokenizer_type="SentencePieceTokenizer"):
        self._arguments = (model_file, tokenizer_type)
        sentencepiece = import_sentencepiece(tokenizer_type)
        if not os.path.isfile(model_file):
            raise TokenizerError(f"--tokenizer-model {model_file}: no such file")
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"--tokenizer-model {model_file}: not a SentencePiece model that "
                                 f"loads ({err})") from None
        if self._processor.eos_id() < 0:
            raise TokenizerError(f"--tokenizer-model {model_file}: the SentencePiece model has no eos "
                                 "piece, which is needed as eod (train it with an eos_id)")
        self.eod = self._processor.eos_id()
        self.bos = self._processor.bos_id() if self._processor.bos_id() >= 0 else None
        self.vocab_size = self._processor.get_piece_size()
        self.inv_vocab = {token_id: self._processor.id_to_piece(token_id) for token_id in range(self.vocab_size)}
        self.vocab = {token: token_id for token_id, token in self.inv_vocab.items()}
        self.is_fast = True
        self.fast_path_reason = "sentencepiece"

    def __reduce__(self):
        return SentencePieceTokenizer, self._arguments

    def tokenize(self, text):
        """Token ids of ``text`` (``encode``, no BOS or EOS): list[int]."""
        return self._processor.encode(text)

    def tokenize_batch(self, texts):
        """``[tokenize(t) for t in texts]`` in one call."""
        if not texts:
            return []
        return self._processor.encode(list(texts))

    def detokenize(self, ids):
        """Text of ``ids`` (``decode``)."""
        return self._processor.decode([int(token_id) for token_id in ids])
