"""GPT-2 byte-level BPE files: the byte alphabet, ``vocab.json`` and ``merges.txt``.

Byte-level BPE works on the UTF-8 bytes of the text. Every byte b is written as one printable
character ``bytes_to_unicode()[b]``, so that ``vocab.json`` (token string -> id) and ``merges.txt``
(one merge "left right" per line, in rank order) hold plain strings. A token written in this
alphabet stands for its bytes; any other token (an added special token) for its UTF-8 text.

Shared by the regex reference (``gpt2_bpe``) and the compiled fast paths (``fast_bpe``); it imports
neither. ``TokenizerError`` is the one error every tokenizer raises.
"""
import functools
import json

import regex

EOD_TOKEN = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer cannot be built or used: bad files, unsupported type, or unloadable model."""


@functools.lru_cache(maxsize=1)
def bytes_to_unicode():
    """GPT-2's map byte -> printable character, as a dict of 256 entries.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map to themselves, in that
    order; the 68 others (control characters, space, DEL, NBSP, soft hyphen) map to ``chr(256 + n)``
    in increasing byte order. The insertion order of the dict is GPT-2's byte order, which is also
    the order of ids 0..255 in GPT-2's ``vocab.json``.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def read_vocab_file(vocab_file):
    """Load a GPT-2 ``vocab.json`` (token string -> id); raises TokenizerError naming the file."""
    try:
        with open(vocab_file, encoding="utf-8") as handle:
            vocab = json.load(handle)
    except FileNotFoundError as err:
        raise TokenizerError(f"--vocab-file {vocab_file}: no such file") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerError(f"--vocab-file {vocab_file}: not a JSON file ({err})") from err
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(f"--vocab-file {vocab_file}: expected a non-empty JSON object "
                             "mapping token strings to ids")
    for token, token_id in vocab.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise TokenizerError(f"--vocab-file {vocab_file}: token {token!r} has id {token_id!r}, "
                                 "expected a non-negative integer")
    if len(set(vocab.values())) != len(vocab):
        raise TokenizerError(f"--vocab-file {vocab_file}: several tokens share one id")
    return vocab


def read_merge_file(merge_file):
    """Load a GPT-2 ``merges.txt`` as a list of (left, right) pairs in rank order.

    An optional first line starting with ``#version`` and blank lines are skipped; every other line
    must hold exactly two space-separated tokens.
    """
    try:
        with open(merge_file, encoding="utf-8") as handle:
            lines = handle.read().split("\n")
    except FileNotFoundError as err:
        raise TokenizerError(f"--merge-file {merge_file}: no such file") from err
    except UnicodeDecodeError as err:
        raise TokenizerError(f"--merge-file {merge_file}: not UTF-8 text ({err})") from err
    merges = []
    for line_number, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line or (line_number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenizerError(f"--merge-file {merge_file}:{line_number}: expected two tokens "
                                 f"separated by one space, got {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


@functools.lru_cache(maxsize=1)
def _byte_char_codec():
    """(translate table byte char -> Latin-1 char of its byte, regex of a non-byte character)."""
    to_latin1 = {ord(char): byte for byte, char in bytes_to_unicode().items()}
    alphabet = "".join(regex.escape(char) for char in bytes_to_unicode().values())
    return to_latin1, regex.compile(f"[^{alphabet}]")


def byte_token_bytes(token):
    """Bytes of a token written in the byte alphabet, or None if it is not (a special token)."""
    to_latin1, non_byte_char = _byte_char_codec()
    if non_byte_char.search(token):
        return None
    return token.translate(to_latin1).encode("latin-1")


def token_bytes_by_id(vocab):
    """List id -> bytes of the token (None where no token has that id).

    Tokens written in the byte alphabet stand for their bytes (``<|endoftext|>`` is plain ASCII,
    so it stands for itself); any other token (an added special token) stands for its UTF-8 text.
    """
    table = [None] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        token_bytes = byte_token_bytes(token)
        table[token_id] = token.encode("utf-8") if token_bytes is None else token_bytes
    return table


def check_merges_in_vocab(vocab, merges, merge_file):
    """Raise TokenizerError unless every merge's parts and result are vocabulary tokens."""
    for rank, (left, right) in enumerate(merges):
        for token in (left, right, left + right):
            if token not in vocab:
                raise TokenizerError(f"--merge-file {merge_file}: merge {rank} "
                                     f"({left!r} {right!r}) uses token {token!r}, which is not "
                                     "in the vocabulary")
