"""pretrain_gpt.py with the tokenizers of Llama-class models: a SentencePiece model read through
--tokenizer-model trains on data preprocessed with it; a bad file is one line naming the flag (exit 2)."""
import pytest

from tests.core.tokenizer.llama_style import train_sentencepiece
from tests.tools.test_preprocess_llama_tokenizers import small_corpus  # noqa: F401
from tests.training.pretrain_helpers import TINY_MODEL, run_pretrain, training_lines
from tools.preprocess_data import preprocess, run_tool

RUN_FLAGS = TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
                          "--log-interval", "1", "--num-workers", "0", "--valid-num-workers", "0", "--split", "100,0,0",
                          "--eod-mask-loss", "--reset-position-ids"]


@pytest.fixture(scope="module")
def sentencepiece_data(tmp_path_factory, small_corpus):  # noqa: F811
    pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("spm_data")
    model = train_sentencepiece(directory / "tokenizer.model", vocab_size=1000)
    status = run_tool(preprocess, ["--input", small_corpus, "--output-prefix", str(directory / "docs"),
                                   "--append-eod", "--tokenizer-type", "SentencePieceTokenizer",
                                   "--tokenizer-model", model])
    assert status == 0
    return model, str(directory / "docs_text_document")


def test_trains_with_a_sentencepiece_model(sentencepiece_data, tmp_path):
    model, data_prefix = sentencepiece_data
    output = run_pretrain(RUN_FLAGS + ["--data-path", data_prefix, "--data-cache-path", str(tmp_path),
                                       "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model]).stdout
    lines = training_lines(output)
    assert [line["iteration"] for line in lines] == [1, 2]
    assert all(0 < line["lm loss"] < 20 for line in lines)


def test_a_bad_tokenizer_model_is_one_line(sentencepiece_data, tmp_path):
    _, data_prefix = sentencepiece_data
    garbage = tmp_path / "tokenizer.model"
    garbage.write_bytes(b"not a model")
    result = run_pretrain(RUN_FLAGS + ["--data-path", data_prefix, "--data-cache-path", str(tmp_path / "cache"),
                                       "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                       str(garbage)], check=False)
    assert result.returncode == 2
    assert f"--tokenizer-model {garbage}: not a SentencePiece model that loads" in result.stdout
    assert "Traceback" not in result.stdout and not (tmp_path / "cache").exists()
