"""Prompts of generation and of the server start with the tokenizer's BOS where it has one: the
server's length check counts it, and an empty prompt starts from it."""
import pytest

from megatron.core.tokenizer import build_tokenizer, prompt_tokens
from tests.core.tokenizer.llama_style import train_sentencepiece
from tools.run_text_generation_server import RequestError, parse_request


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    model = train_sentencepiece(tmp_path_factory.mktemp("spm") / "tokenizer.model", vocab_size=1000)
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)


def test_server_counts_the_bos(sentencepiece_tokenizer):
    prompt = "def main():"
    tokens = prompt_tokens(sentencepiece_tokenizer, prompt)
    assert tokens[0] == sentencepiece_tokenizer.bos and tokens[1:] == sentencepiece_tokenizer.tokenize(prompt)
    seq_length = len(tokens) + 4
    assert parse_request({"prompts": [prompt], "tokens_to_generate": 4}, sentencepiece_tokenizer, seq_length)
    with pytest.raises(RequestError, match=f"prompt 0 has {len(tokens)} tokens: with tokens_to_generate 5"):
        parse_request({"prompts": [prompt], "tokens_to_generate": 5}, sentencepiece_tokenizer, seq_length)


def test_empty_prompt_starts_from_the_bos_or_the_eod(sentencepiece_tokenizer, gpt2_tokenizer_files):
    assert prompt_tokens(sentencepiece_tokenizer, "") == [sentencepiece_tokenizer.bos]
    gpt2 = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    assert prompt_tokens(gpt2, "") == [gpt2.eod] and prompt_tokens(gpt2, "Hi") == gpt2.tokenize("Hi")
