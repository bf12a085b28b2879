"""Shared logic of the preprocessing tools: jsonl lines -> checked documents -> token arrays.

The input is read in chunks of consecutive lines (``read_line_chunks``); a ``ChunkEncoder``
turns a chunk into one ``EncodedDocuments`` per json key (flat tokens, item sizes, items per
document) that ``IndexedDatasetBuilder.add_documents`` appends in one call. Encoding is a pure
function of the chunk, so chunks may be encoded in any process and order and written in input
order, which makes serial and parallel runs byte-identical.

A line is *bad* when it cannot yield a document for every json key; bad lines are skipped and
counted by kind (``BAD_LINE_KINDS``) in a ``BadLineReport``. A bad line contributes to no output,
so the datasets of several json keys stay aligned document by document.
"""
import dataclasses
import glob
import gzip
import itertools
import json
import lzma
import multiprocessing
import os
import sys
import time
import zlib
from collections import Counter, deque

import numpy as np

from megatron.core.data.indexed_dataset import best_fitting_dtype

BAD_LINE_KINDS = {
    "invalid_utf8": "line is not valid UTF-8",
    "blank_line": "line is empty or whitespace only",
    "malformed_json": "line is not valid JSON",
    "nested_too_deep": "line nests arrays or objects deeper than the JSON parser allows",
    "truncated_last_line": "last line is cut off (no trailing newline, not valid JSON)",
    "not_an_object": "line is JSON but not an object",
    "missing_key": "a --json-keys key is missing",
    "non_string_text": "a --json-keys value is not a string",
    "empty_text": "document text is empty or whitespace only",
    "tokenizer_error": "the tokenizer failed on the text",
    "no_tokens": "the text yields no tokens",
}
_UTF8_BOM = b"\xef\xbb\xbf"
_READ_BUFFER_BYTES = 1 << 20


class PreprocessingError(ValueError):
    """Bad flags or input for preprocessing; the message names the flag, file or file:line."""


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """How to build the tokenizer (the ``--tokenizer-*``, ``--vocab-file``, ``--merge-file`` flags)."""

    tokenizer_type: str
    vocab_file: str = None
    merge_file: str = None
    tokenizer_name_or_path: str = None
    tokenizer_model: str = None

    def build(self):
        from megatron.core.tokenizer import build_tokenizer
        return build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file, merge_file=self.merge_file,
                               tokenizer_name_or_path=self.tokenizer_name_or_path,
                               tokenizer_model=self.tokenizer_model)


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """What one document becomes: which json keys, sentence splitting, and a trailing eod (the
    tokenizer's BOS, where it has one, always starts the document)."""

    tokenizer: TokenizerSpec
    json_keys: tuple = ("text",)
    split_sentences: bool = False
    keep_newlines: bool = False
    append_eod: bool = False


@dataclasses.dataclass
class LineChunk:
    """Consecutive raw lines of one input file; ``lines[i]`` is line ``first_line + i`` (1-based)."""

    index: int
    path: str
    first_line: int
    lines: list
    nbytes: int


@dataclasses.dataclass(frozen=True)
class BadLine:
    kind: str
    path: str
    line: int

    def describe(self):
        return f"{self.path}:{self.line}: {BAD_LINE_KINDS[self.kind]} ({self.kind})"


@dataclasses.dataclass
class EncodedDocuments:
    """Documents of one json key: ``tokens`` [T], ``sizes`` [items] int32, ``doc_item_counts`` [docs]."""

    tokens: np.ndarray
    sizes: np.ndarray
    doc_item_counts: np.ndarray


@dataclasses.dataclass
class EncodedChunk:
    """A ``LineChunk`` after encoding: documents per json key, and what was skipped."""

    index: int
    documents_by_key: dict
    lines: int
    nbytes: int
    bad_lines: list

    @property
    def documents(self):
        return len(next(iter(self.documents_by_key.values())).doc_item_counts)

    @property
    def tokens(self):
        return sum(len(documents.tokens) for documents in self.documents_by_key.values())


def output_prefix_for(output_prefix, key, split_sentences):
    """``<output_prefix>_<key>_document`` (or ``_sentence`` with --split-sentences)."""
    level = "sentence" if split_sentences else "document"
    return f"{output_prefix}_{key}_{level}"


def expand_input_paths(patterns):
    """Files named by ``--input``: each a path or a glob (sorted), in order, without duplicates."""
    paths = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matched:
            raise PreprocessingError(f"--input {pattern}: the glob matches no file")
        for path in matched:
            if os.path.isdir(path):
                raise PreprocessingError(f"--input {path}: is a directory; give the jsonl files in it, "
                                         f"or a glob such as {os.path.join(path, '*.jsonl')}")
            if not os.path.exists(path):
                raise PreprocessingError(f"--input {path}: no such file")
            if path not in paths:
                paths.append(path)
    return paths


def open_jsonl(path):
    """Open ``path`` for reading bytes, decompressing ``.gz`` and ``.xz``."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    return open(path, "rb", buffering=_READ_BUFFER_BYTES)


def read_line_chunks(paths, lines_per_chunk):
    """Yield ``LineChunk``s of up to ``lines_per_chunk`` lines; a chunk never spans two files.

    A corrupt compressed stream stops the run with a PreprocessingError naming the file and the
    last line read, since nothing after it can be trusted.
    """
    if lines_per_chunk < 1:
        raise PreprocessingError(f"--chunk-size must be at least 1, got {lines_per_chunk}")
    index = 0
    for path in paths:
        next_line = 1
        try:
            with open_jsonl(path) as source:
                while True:
                    lines = list(itertools.islice(source, lines_per_chunk))
                    if not lines:
                        break
                    if next_line == 1 and lines[0].startswith(_UTF8_BOM):
                        lines[0] = lines[0][len(_UTF8_BOM):]
                    yield LineChunk(index, path, next_line, lines, sum(map(len, lines)))
                    index += 1
                    next_line += len(lines)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as error:
            raise PreprocessingError(
                f"{path}: cannot read past line {next_line - 1}: {error}") from error


def parse_line(raw, json_keys):
    """The texts of ``json_keys`` in the jsonl line ``raw`` (bytes), or the kind of problem (a str).

    A line without a trailing newline is the last line of its file; if it does not decode or
    parse, it was cut off (``truncated_last_line``).
    """
    try:
        line = raw.decode("utf-8")
        record = json.loads(line)
    except UnicodeDecodeError:
        return "invalid_utf8" if raw.endswith(b"\n") else "truncated_last_line"
    except RecursionError:
        return "nested_too_deep"
    except ValueError:
        if line.isspace() or not line:
            return "blank_line"
        return "malformed_json" if raw.endswith(b"\n") else "truncated_last_line"
    if not isinstance(record, dict):
        return "not_an_object"
    texts = []
    for key in json_keys:
        if key not in record:
            return "missing_key"
        text = record[key]
        if not isinstance(text, str):
            return "non_string_text"
        if not text or text.isspace():
            return "empty_text"
        texts.append(text)
    return texts


def top_level_keys(paths, max_lines=1000):
    """(sorted keys of the JSON objects, lines read) over the first ``max_lines`` lines of the
    input, files taken in order: what the input offers, for an error that says why no line had the
    ``--json-keys``."""
    keys = set()
    lines_read = 0
    for path in paths:
        with open_jsonl(path) as source:
            for raw in itertools.islice(source, max_lines - lines_read):
                lines_read += 1
                try:
                    record = json.loads(raw.decode("utf-8").lstrip("\ufeff"))
                except (UnicodeDecodeError, ValueError, RecursionError):
                    continue
                if isinstance(record, dict):
                    keys.update(map(str, record))
        if lines_read == max_lines:
            break
    return sorted(keys), lines_read


def _listing(items, most=None):
    """``items`` joined by commas, the first ``most`` of them and "..." when there are more."""
    return ", ".join(items[:most]) + (", ..." if most is not None and len(items) > most else "")


def no_documents_error(paths, json_keys, max_keys=20, max_paths=3):
    """The PreprocessingError of a run whose every line was skipped. It names the input, the
    ``--json-keys`` asked for, the keys that the first lines do have, and those of ``json_keys``
    that none of them has."""
    inputs = _listing(paths, max_paths)
    found, lines_read = top_level_keys(paths)
    if lines_read == 0:
        return PreprocessingError(f"{inputs}: the input has no lines, so no dataset was written")
    asked = _listing([repr(key) for key in json_keys])
    absent = _listing([repr(key) for key in json_keys if key not in found])
    if not found:
        detail = f"none of its first {lines_read} lines is a JSON object"
    else:
        detail = f"its first {lines_read} lines have the keys {_listing([repr(key) for key in found], max_keys)}"
        detail += f", and none has {absent}" if absent else ""
    return PreprocessingError(
        f"{inputs}: no line has usable text under --json-keys {asked}, so no dataset was written; "
        f"{detail} (the summary above counts the skipped lines by kind)")


class _KeepWhitespaceSplitter:
    """Punkt sentences where the whitespace after a sentence (newlines included) stays with it.

    Sentence i is ``text[start_i:start_{i+1}]``; the last one ends where Punkt ends it (trailing
    whitespace of the document dropped), so joining the sentences gives ``text.rstrip()``.
    """

    def __init__(self, punkt):
        self._punkt = punkt

    def tokenize(self, text):
        spans = list(self._punkt.span_tokenize(text))
        return [text[start:next_start] for (start, _), (next_start, _) in zip(spans, spans[1:])] + \
            [text[start:end] for start, end in spans[-1:]]


def build_sentence_splitter(keep_newlines, language="english"):
    """NLTK's Punkt sentence splitter for ``language`` (the ``punkt_tab`` model, NLTK >= 3.9).

    Raises PreprocessingError naming --split-sentences when nltk or the model is missing.
    """
    try:
        from nltk.tokenize.punkt import PunktTokenizer
    except ImportError as error:
        raise PreprocessingError(
            f"--split-sentences needs nltk (pip install nltk): {error}") from error
    try:
        punkt = PunktTokenizer(language)
    except LookupError as error:
        raise PreprocessingError(
            f"--split-sentences needs NLTK's punkt_tab model for {language}, which is not "
            f"installed: run `python -m nltk.downloader punkt_tab` or point NLTK_DATA at a "
            f"directory holding tokenizers/punkt_tab/{language}/") from error
    return _KeepWhitespaceSplitter(punkt) if keep_newlines else punkt


class ChunkEncoder:
    """Encodes ``LineChunk``s into ``EncodedChunk``s with one tokenizer (built once per process).

    Per document and json key: the text (or its sentences) is tokenized; empty token lists are
    dropped; the tokenizer's BOS (Llama's ``<s>``), where it has one, starts the first item, and
    with ``append_eod`` the eod id ends the last item. The token dtype is
    ``best_fitting_dtype(tokenizer.vocab_size)``.
    """

    def __init__(self, config, tokenizer=None):
        from megatron.core.tokenizer import bos_of
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else config.tokenizer.build()
        self._bos = bos_of(self.tokenizer)
        self.dtype = np.dtype(best_fitting_dtype(self.tokenizer.vocab_size))
        self._splitter = build_sentence_splitter(config.keep_newlines) if config.split_sentences else None

    def encode(self, chunk):
        keys = self.config.json_keys
        bad_lines = []
        line_numbers = []
        texts_by_key = [[] for _ in keys]
        for offset, raw in enumerate(chunk.lines):
            parsed = parse_line(raw, keys)
            if isinstance(parsed, str):
                bad_lines.append(BadLine(parsed, chunk.path, chunk.first_line + offset))
                continue
            line_numbers.append(chunk.first_line + offset)
            for texts, text in zip(texts_by_key, parsed):
                texts.append(text)
        items_by_key = [self._tokenize_documents(texts) for texts in texts_by_key]
        keep = []
        for position, line_number in enumerate(line_numbers):
            documents = [items[position] for items in items_by_key]
            if any(document is None for document in documents):
                bad_lines.append(BadLine("tokenizer_error", chunk.path, line_number))
            elif any(not document for document in documents):
                bad_lines.append(BadLine("no_tokens", chunk.path, line_number))
            else:
                keep.append(position)
        bad_lines.sort(key=lambda bad: bad.line)
        documents_by_key = {key: self._pack([items[p] for p in keep]) for key, items in zip(keys, items_by_key)}
        return EncodedChunk(chunk.index, documents_by_key, len(chunk.lines), chunk.nbytes, bad_lines)

    def _tokenize_documents(self, texts):
        """Per text: its non-empty items (token lists), or None if the tokenizer failed on it."""
        if self._splitter is None:
            return [None if ids is None else ([ids] if ids else []) for ids in self._tokenize_all(texts)]
        sentences = [self._splitter.tokenize(text) for text in texts]
        flat_ids = iter(self._tokenize_all(list(itertools.chain.from_iterable(sentences))))
        documents = []
        for document_sentences in sentences:
            ids_per_sentence = list(itertools.islice(flat_ids, len(document_sentences)))
            if any(ids is None for ids in ids_per_sentence):
                documents.append(None)
            else:
                documents.append([ids for ids in ids_per_sentence if ids])
        return documents

    def _tokenize_all(self, texts):
        """Token ids per text; where the batch call fails, each text alone (None if it fails)."""
        try:
            return self.tokenizer.tokenize_batch(texts)
        except Exception:  # one undecodable document must not stop a long job; find which one
            return [self._tokenize_or_none(text) for text in texts]

    def _tokenize_or_none(self, text):
        try:
            return self.tokenizer.tokenize(text)
        except Exception:  # reported as a tokenizer_error bad line
            return None

    def _pack(self, documents):
        """Flatten documents (lists of token lists) into one EncodedDocuments."""
        eod = (self.tokenizer.eod,) if self.config.append_eod else None
        pieces = []
        sizes = []
        for items in documents:
            if self._bos is not None:
                pieces.append((self._bos,))
                sizes.append(1)
            for position, ids in enumerate(items):
                pieces.append(ids)
                if self._bos is not None and position == 0:
                    sizes[-1] += len(ids)
                else:
                    sizes.append(len(ids))
            if eod is not None:
                pieces.append(eod)
                sizes[-1] += 1
        try:
            tokens = np.fromiter(itertools.chain.from_iterable(pieces), dtype=self.dtype, count=sum(sizes))
        except OverflowError as error:
            raise PreprocessingError(
                f"a token id does not fit {self.dtype}, the dtype chosen for a vocabulary of "
                f"{self.tokenizer.vocab_size}: {error}") from error
        doc_item_counts = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        return EncodedDocuments(tokens, np.array(sizes, dtype=np.int32), doc_item_counts)


class BadLineReport:
    """Counts of bad lines by kind, with the first ``max_examples`` locations of each kind."""

    def __init__(self, max_examples=5):
        self.max_examples = max_examples
        self.counts = Counter()
        self.examples = {}

    def add(self, bad_lines):
        for bad in bad_lines:
            self.counts[bad.kind] += 1
            examples = self.examples.setdefault(bad.kind, [])
            if len(examples) < self.max_examples:
                examples.append(bad)

    @property
    def total(self):
        return sum(self.counts.values())

    def summary_lines(self):
        """Human-readable summary: one line per kind, with its first locations."""
        if not self.total:
            return ["No bad lines."]
        lines = [f"Skipped {self.total} bad lines:"]
        for kind, description in BAD_LINE_KINDS.items():
            if self.counts[kind]:
                where = ", ".join(f"{bad.path}:{bad.line}" for bad in self.examples[kind])
                more = ", ..." if self.counts[kind] > len(self.examples[kind]) else ""
                lines.append(f"  {kind}: {self.counts[kind]} ({description}); at {where}{more}")
        return lines


def strict_error(bad_line):
    """The error ``--strict`` raises for the first bad line."""
    return PreprocessingError(f"{bad_line.describe()}; stopping because of --strict")


class ProgressReporter:
    """Periodic ``Processed N documents (X docs/s, Y MB/s).`` lines; Y counts jsonl bytes read.

    A line is printed whenever the count of input lines crosses a multiple of ``log_interval``.
    """

    def __init__(self, log_interval, stream=None):
        if log_interval < 1:
            raise PreprocessingError(f"--log-interval must be at least 1, got {log_interval}")
        self.log_interval = log_interval
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.lines = 0
        self.nbytes = 0
        self.documents = 0
        self.tokens = 0

    def update(self, lines, nbytes, documents, tokens):
        """Account for one processed chunk; print a line if a multiple of log_interval was crossed."""
        before = self.lines // self.log_interval
        self.lines += lines
        self.nbytes += nbytes
        self.documents += documents
        self.tokens += tokens
        if self.lines // self.log_interval > before:
            print(self.rate_line(f"Processed {self.lines} documents"), file=self.stream, flush=True)

    def elapsed(self):
        return max(time.perf_counter() - self.start, 1e-9)

    def rate_line(self, head):
        elapsed = self.elapsed()
        return f"{head} ({self.lines / elapsed:.1f} docs/s, {self.nbytes / elapsed / 1e6:.2f} MB/s)."

    def summary_lines(self, output_prefixes):
        """Final lines: totals, throughput, and what was written where."""
        return [
            self.rate_line(f"Done: read {self.lines} lines ({self.nbytes / 1e6:.2f} MB) in {self.elapsed():.2f} s"),
            f"Wrote {self.documents} documents, {self.tokens} tokens to "
            + ", ".join(f"{prefix}.bin/.idx" for prefix in output_prefixes),
        ]


_PROCESS_ENCODER = None
_EXHAUSTED = object()


def init_process_encoder(config):
    """Pool initializer: the ChunkEncoder of this process (inherited as is from a forked parent)."""
    global _PROCESS_ENCODER
    if _PROCESS_ENCODER is None or _PROCESS_ENCODER.config != config:
        _PROCESS_ENCODER = ChunkEncoder(config)


def set_process_encoder(encoder):
    """Make ``encoder`` this process's encoder, so forked workers start with it already built."""
    global _PROCESS_ENCODER
    _PROCESS_ENCODER = encoder


def encode_in_process(chunk):
    """Encode ``chunk`` with this process's encoder (see init_process_encoder)."""
    return _PROCESS_ENCODER.encode(chunk)


def pool_context():
    """fork where the platform has it (workers inherit the built tokenizer), else spawn."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


def map_in_order(pool, function, items, in_flight):
    """``map(function, items)`` on ``pool``, results in input order, at most ``in_flight`` pending.

    Items are drawn lazily, so memory stays bounded however long ``items`` is; workers still
    finish out of order, and later results wait until the earlier ones are taken.
    """
    pending = deque()
    items = iter(items)
    exhausted = False
    while True:
        while not exhausted and len(pending) < in_flight:
            item = next(items, _EXHAUSTED)
            if item is _EXHAUSTED:
                exhausted = True
            else:
                pending.append(pool.apply_async(function, (item,)))
        if not pending:
            return
        yield pending.popleft().get()
