"""Reading, validating and encoding jsonl lines for the preprocessing tools."""
import gzip
import io
import itertools
import json
import lzma
import multiprocessing
import os
import re
import sys
import time

import numpy as np
import pytest

from megatron.core.data.preprocessing import (
    BAD_LINE_KINDS,
    BadLine,
    BadLineReport,
    ChunkEncoder,
    EncoderConfig,
    LineChunk,
    PreprocessingError,
    ProgressReporter,
    TokenizerSpec,
    build_sentence_splitter,
    expand_input_paths,
    map_in_order,
    output_prefix_for,
    parse_line,
    read_line_chunks,
)

PUNKT_TRAINING_DOCUMENTS = 100


@pytest.fixture(scope="session")
def punkt_data_dir(tmp_path_factory, sample_corpus):
    """An NLTK data directory with a punkt_tab 'english' model trained offline on the corpus."""
    import nltk
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    root = tmp_path_factory.mktemp("nltk_data")
    with gzip.open(sample_corpus, "rt", encoding="utf-8") as corpus:
        texts = [json.loads(line)["text"] for line in itertools.islice(corpus, PUNKT_TRAINING_DOCUMENTS)]
    trainer = PunktTrainer()
    trainer.train("\n\n".join(texts), finalize=True)
    model_dir = root / "tokenizers" / "punkt_tab" / "english"
    model_dir.mkdir(parents=True)
    # NLTK only writes under a directory of its data path.
    saved_path = list(nltk.data.path)
    nltk.data.path.append(str(root))
    try:
        save_punkt_params(trainer.get_params(), dir=str(model_dir))
    finally:
        nltk.data.path[:] = saved_path
    return str(root)


@pytest.fixture
def use_punkt(punkt_data_dir, monkeypatch):
    """Point NLTK (in this process and in subprocesses) at the offline punkt model."""
    import nltk

    monkeypatch.setenv("NLTK_DATA", punkt_data_dir)
    monkeypatch.setattr(nltk.data, "path", [punkt_data_dir])
    return punkt_data_dir


@pytest.fixture
def gpt2_spec(gpt2_tokenizer_files):  # noqa: F811
    vocab_file, merge_file = gpt2_tokenizer_files
    return TokenizerSpec("GPT2BPETokenizer", vocab_file, merge_file)


@pytest.mark.parametrize("raw, expected", [
    (b'{"text": "hello"}\n', ["hello"]),
    (b'{"text": "hello"}', ["hello"]),
    (b'{"text": "caf\xc3\xa9"}\r\n', ["caf\u00e9"]),
    (b'{"text": "bad \xff byte"}\n', "invalid_utf8"),
    (b'{"text": "cut \xc3', "truncated_last_line"),
    (b'{"text": "cut of', "truncated_last_line"),
    (b"\n", "blank_line"),
    (b"  \t\n", "blank_line"),
    (b'{"text": "x",}\n', "malformed_json"),
    (b'{"text": "x"} trailing\n', "malformed_json"),
    (b'["text", "x"]\n', "not_an_object"),
    (b'"just a string"\n', "not_an_object"),
    (b'{"body": "x"}\n', "missing_key"),
    (b'{"text": 42}\n', "non_string_text"),
    (b'{"text": null}\n', "non_string_text"),
    (b'{"text": ["a", "b"]}\n', "non_string_text"),
    (b'{"text": ""}\n', "empty_text"),
    (b'{"text": " \\n\\t "}\n', "empty_text"),
])
def test_parse_line_kinds(raw, expected):
    assert parse_line(raw, ("text",)) == expected


def test_parse_line_several_keys():
    assert parse_line(b'{"title": "T", "text": "body"}\n', ("text", "title")) == ["body", "T"]
    assert parse_line(b'{"text": "body"}\n', ("text", "title")) == "missing_key"
    assert parse_line(b'{"text": "body", "title": " "}\n', ("text", "title")) == "empty_text"


def _write(path, data):
    opener = gzip.open if path.endswith(".gz") else lzma.open if path.endswith(".xz") else open
    with opener(path, "wb") as f:
        f.write(data)
    return path


def test_read_line_chunks_numbers_lines_per_file(tmp_path):
    a = _write(str(tmp_path / "a.jsonl"), b"".join(b'{"text": "a%d"}\n' % i for i in range(5)))
    b = _write(str(tmp_path / "b.jsonl.gz"), b"\xef\xbb\xbf" + b"".join(b'{"text": "b%d"}\n' % i for i in range(3)))
    c = _write(str(tmp_path / "c.jsonl.xz"), b'{"text": "c0"}\n{"text": "c1"}')
    chunks = list(read_line_chunks([a, b, c], lines_per_chunk=2))
    assert [(ch.index, os.path.basename(ch.path), ch.first_line, len(ch.lines)) for ch in chunks] == [
        (0, "a.jsonl", 1, 2), (1, "a.jsonl", 3, 2), (2, "a.jsonl", 5, 1),
        (3, "b.jsonl.gz", 1, 2), (4, "b.jsonl.gz", 3, 1), (5, "c.jsonl.xz", 1, 2)]
    assert chunks[3].lines[0] == b'{"text": "b0"}\n'
    assert chunks[5].lines[1] == b'{"text": "c1"}'
    assert all(ch.nbytes == sum(map(len, ch.lines)) for ch in chunks)


def test_read_line_chunks_reports_corrupt_compressed_input(tmp_path):
    good = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(1000)))
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(PreprocessingError, match=r"broken\.jsonl\.gz: cannot read past line"):
        list(read_line_chunks([str(path)], 10))
    with pytest.raises(PreprocessingError, match="--chunk-size"):
        list(read_line_chunks([str(path)], 0))


def test_expand_input_paths(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / name).write_text("")
    paths = expand_input_paths([str(tmp_path / "*.jsonl"), str(tmp_path / "c.txt"), str(tmp_path / "a.jsonl")])
    assert [os.path.basename(p) for p in paths] == ["a.jsonl", "b.jsonl", "c.txt"]
    with pytest.raises(PreprocessingError, match=r"--input .*\*\.none: the glob matches no file"):
        expand_input_paths([str(tmp_path / "*.none")])
    with pytest.raises(PreprocessingError, match=r"--input .*missing\.jsonl: no such file"):
        expand_input_paths([str(tmp_path / "missing.jsonl")])


def test_output_prefix_for():
    assert output_prefix_for("out/corpus", "text", False) == "out/corpus_text_document"
    assert output_prefix_for("out/corpus", "title", True) == "out/corpus_title_sentence"


def _chunk(lines, path="in.jsonl", first_line=1, index=0):
    return LineChunk(index, path, first_line, lines, sum(map(len, lines)))


def _record(**fields):
    return json.dumps(fields).encode() + b"\n"


def test_encoder_matches_the_tokenizer_and_skips_bad_lines(gpt2_spec):
    tokenizer = gpt2_spec.build()
    texts = ["Hello world.", "Second document\nwith two lines.", "caf\u00e9 \u2603 \U0001F600"]
    lines = [_record(text=texts[0]), b"not json\n", _record(text=texts[1]), _record(text="  "),
             _record(other="x"), _record(text=texts[2])]
    encoder = ChunkEncoder(EncoderConfig(gpt2_spec, append_eod=True), tokenizer)
    encoded = encoder.encode(_chunk(lines, first_line=11))
    documents = encoded.documents_by_key["text"]
    expected = [tokenizer.tokenize(text) + [tokenizer.eod] for text in texts]
    assert documents.tokens.dtype == np.uint16
    assert documents.tokens.tolist() == list(itertools.chain.from_iterable(expected))
    assert documents.sizes.tolist() == [len(ids) for ids in expected]
    assert documents.doc_item_counts.tolist() == [1, 1, 1]
    assert [(bad.kind, bad.line) for bad in encoded.bad_lines] == [
        ("malformed_json", 12), ("empty_text", 14), ("missing_key", 15)]
    assert (encoded.lines, encoded.nbytes, encoded.documents) == (6, sum(map(len, lines)), 3)


def test_encoder_keeps_json_keys_aligned(gpt2_spec):
    tokenizer = gpt2_spec.build()
    lines = [_record(text="body one", title="one"), _record(text="body two"),
             _record(text="body three", title="three")]
    encoder = ChunkEncoder(EncoderConfig(gpt2_spec, json_keys=("text", "title")), tokenizer)
    encoded = encoder.encode(_chunk(lines))
    for key, texts in (("text", ["body one", "body three"]), ("title", ["one", "three"])):
        documents = encoded.documents_by_key[key]
        assert documents.tokens.tolist() == tokenizer.tokenize(texts[0]) + tokenizer.tokenize(texts[1])
    assert [(bad.kind, bad.line) for bad in encoded.bad_lines] == [("missing_key", 2)]


class _FailingTokenizer:
    """Wraps a tokenizer: fails on texts containing 'BOOM', returns no ids for 'NOTHING'."""

    def __init__(self, inner, vocab_size=None):
        self.inner = inner
        self.eod = inner.eod
        self.vocab_size = vocab_size or inner.vocab_size

    def tokenize(self, text):
        if "BOOM" in text:
            raise ValueError("cannot encode")
        return [] if "NOTHING" in text else self.inner.tokenize(text)

    def tokenize_batch(self, texts):
        return [self.tokenize(text) for text in texts]


def test_encoder_reports_tokenizer_failures_and_empty_results(gpt2_spec):
    tokenizer = _FailingTokenizer(gpt2_spec.build())
    lines = [_record(text="fine"), _record(text="a BOOM here"), _record(text="NOTHING"), _record(text="ok")]
    encoded = ChunkEncoder(EncoderConfig(gpt2_spec, append_eod=True), tokenizer).encode(_chunk(lines))
    assert [(bad.kind, bad.line) for bad in encoded.bad_lines] == [("tokenizer_error", 2), ("no_tokens", 3)]
    assert encoded.documents == 2


def test_encoder_uses_int32_for_large_vocabularies(gpt2_spec):
    class LargeIds(_FailingTokenizer):
        def tokenize(self, text):
            return [70000 + i for i in self.inner.tokenize(text)]

    tokenizer = LargeIds(gpt2_spec.build(), vocab_size=100000)
    encoded = ChunkEncoder(EncoderConfig(gpt2_spec), tokenizer).encode(_chunk([_record(text="big ids")]))
    tokens = encoded.documents_by_key["text"].tokens
    assert tokens.dtype == np.int32 and tokens.min() >= 70000


def test_encoder_rejects_ids_outside_the_dtype(gpt2_spec):
    class Overflowing(_FailingTokenizer):
        def tokenize(self, text):
            return [65536]

    encoder = ChunkEncoder(EncoderConfig(gpt2_spec), Overflowing(gpt2_spec.build()))
    with pytest.raises(PreprocessingError, match="does not fit uint16"):
        encoder.encode(_chunk([_record(text="x")]))


def test_sentence_splitting(gpt2_spec, use_punkt):
    tokenizer = gpt2_spec.build()
    text = "The first sentence is here. The second one follows!\nA third line ends it.  \n"
    splitter = build_sentence_splitter(keep_newlines=False)
    sentences = splitter.tokenize(text)
    assert sentences == ["The first sentence is here.", "The second one follows!", "A third line ends it."]
    keeping = build_sentence_splitter(keep_newlines=True).tokenize(text)
    assert keeping == ["The first sentence is here. ", "The second one follows!\n", "A third line ends it."]
    config = EncoderConfig(gpt2_spec, split_sentences=True, append_eod=True)
    encoded = ChunkEncoder(config, tokenizer).encode(_chunk([_record(text=text), _record(text="Alone.")]))
    documents = encoded.documents_by_key["text"]
    expected_items = [tokenizer.tokenize(s) for s in sentences] + [tokenizer.tokenize("Alone.")]
    expected_items[2].append(tokenizer.eod)
    expected_items[3].append(tokenizer.eod)
    assert documents.sizes.tolist() == [len(item) for item in expected_items]
    assert documents.doc_item_counts.tolist() == [3, 1]
    assert documents.tokens.tolist() == list(itertools.chain.from_iterable(expected_items))


def test_keep_newlines_sentences_join_to_the_text(sample_corpus, use_punkt):
    splitter = build_sentence_splitter(keep_newlines=True)
    with gzip.open(sample_corpus, "rt", encoding="utf-8") as corpus:
        for line in itertools.islice(corpus, 50):
            text = json.loads(line)["text"]
            sentences = splitter.tokenize(text)
            assert "".join(sentences) == text.rstrip()
            assert len(sentences) >= 1


def test_missing_punkt_model_names_the_flag(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(PreprocessingError, match=r"--split-sentences needs NLTK's punkt_tab model"):
        build_sentence_splitter(keep_newlines=False)


def test_missing_nltk_names_the_flag(monkeypatch):
    monkeypatch.setitem(sys.modules, "nltk.tokenize.punkt", None)
    with pytest.raises(PreprocessingError, match=r"--split-sentences needs nltk"):
        build_sentence_splitter(keep_newlines=False)


def test_bad_line_report_keeps_first_examples_per_kind():
    report = BadLineReport(max_examples=2)
    report.add([BadLine("malformed_json", "a.jsonl", n) for n in (3, 9, 12)])
    report.add([BadLine("invalid_utf8", "b.jsonl", 7)])
    assert report.total == 4 and report.counts == {"malformed_json": 3, "invalid_utf8": 1}
    summary = "\n".join(report.summary_lines())
    assert "Skipped 4 bad lines:" in summary
    assert "malformed_json: 3 (line is not valid JSON); at a.jsonl:3, a.jsonl:9, ..." in summary
    assert "invalid_utf8: 1 (line is not valid UTF-8); at b.jsonl:7" in summary
    assert BadLineReport().summary_lines() == ["No bad lines."]
    assert set(BAD_LINE_KINDS) >= set(report.counts)


def test_progress_reporter_prints_rates_at_each_interval():
    stream = io.StringIO()
    progress = ProgressReporter(log_interval=10, stream=stream)
    progress.update(lines=6, nbytes=600, documents=6, tokens=60)
    progress.update(lines=6, nbytes=600, documents=5, tokens=50)
    progress.update(lines=25, nbytes=2500, documents=25, tokens=250)
    printed = stream.getvalue().splitlines()
    assert len(printed) == 2
    assert re.fullmatch(r"Processed 12 documents \([\d.]+ docs/s, [\d.]+ MB/s\)\.", printed[0])
    assert printed[1].startswith("Processed 37 documents")
    summary = progress.summary_lines(["out_text_document"])
    assert "read 37 lines (0.00 MB)" in summary[0] and "36 documents, 360 tokens" in summary[1]
    with pytest.raises(PreprocessingError, match="--log-interval"):
        ProgressReporter(log_interval=0)


def _slow_for_small(value):
    # Earlier items take longer, so workers finish them after later ones.
    time.sleep(0.02 * (5 - value) if value < 5 else 0)
    return value * value


@pytest.mark.distributed
def test_map_in_order_is_ordered_and_bounded():
    drawn = []

    def items():
        for value in range(40):
            drawn.append(value)
            yield value

    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = map_in_order(pool, _slow_for_small, items(), in_flight=3)
        first = next(results)
        assert first == 0 and len(drawn) <= 3
        assert [first] + list(results) == [v * v for v in range(40)]


def test_a_line_nested_too_deep_for_the_parser_is_a_bad_line():
    deep = b'{"text": "t", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    assert parse_line(deep, ("text",)) == "nested_too_deep"
    assert parse_line(b'{"text": "t", "x": [[[1]]]}\n', ("text",)) == ["t"]
