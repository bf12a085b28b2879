"""tools/run_text_generation_server.py on 2 gloo ranks under torchrun (TP=1 x PP=2, the session's
TP2xPP2-trained checkpoint re-cut) and tools/text_generation_cli.py, over HTTP on the loopback address.

One server start checks: 6 concurrent greedy requests (threads) each get the continuation computed
here from the merged model step by step, with log-probabilities equal to the model's; bad requests
and a prompt past the model's 32 positions get 400 with the reason while the server keeps serving;
so do bodies meant to break it (JSON nested 100,000 deep, a lone surrogate, a seed past 64 bits),
and the extremes validation accepts (temperature 1e-300: the greedy text; the largest seed) are
served; seeded sampling repeats; the CLI client prints an answer; SIGTERM to the rank-0 worker
stops both ranks and torchrun with status 0, no traceback (the quiet stop docs/text-generation.md
gives for torchrun, whose own Ctrl-C handling prints one).
"""
import json
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.tokenizer import GPT2BPETokenizer
from tests.conftest import REPO_ROOT
from tests.tasks.trained_checkpoint import SEQ_LENGTH, checkpoint_path, model_flags
from tests.training.e2e_utils import Job, run_command, torchrun_command
from tools.text_generation_cli import put, put_bytes

pytest.importorskip("flask")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SERVER = os.path.join(REPO_ROOT, "tools", "run_text_generation_server.py")
CLIENT = os.path.join(REPO_ROOT, "tools", "text_generation_cli.py")
PROMPTS = ["The history of the", "In 1990, a new", "Valkyria", "It was not until", "Rome", "A"]
NEW_TOKENS = 6


def greedy_text(model, tokenizer, prompt: str) -> tuple[str, list[float]]:
    """prompt + its greedy continuation (step by step on the merged model), and the log-probability
    of every token after the first."""
    tokens = tokenizer.tokenize(prompt)
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0, -1, :tokenizer.vocab_size]
        tokens.append(int(logits.argmax()))
        if tokens[-1] == tokenizer.eod:
            break
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0, :-1, :tokenizer.vocab_size]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    text_tokens = tokens[:-1] if tokens[-1] == tokenizer.eod else tokens
    return tokenizer.detokenize(text_tokens), logprobs.tolist()


def workers_by_local_rank(agent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the children of the torchrun process ``agent`` (each in its own session)."""
    workers = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/environ", "rb") as f:
                environment = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError):
            continue
        if parent == agent and b"LOCAL_RANK" in environment:
            workers[int(environment[b"LOCAL_RANK"])] = int(name)
    return workers


def kill_job_and_workers(job: Job) -> None:
    for pid in workers_by_local_rank(job.processes[0].pid).values():
        os.kill(pid, signal.SIGKILL)
    job.kill()


def check_hostile_requests(url: str, greedy_rome: str) -> None:
    """Bodies meant to break the server get 400 and the reason; the extremes it accepts are served."""
    hostile = {"the body nests too deeply to parse": b"[" * 100_000 + b"]" * 100_000,
               "the body is not JSON": b'{"prompts": ["a"',
               "prompt 0 is not valid Unicode text": b'{"prompts": ["\\ud800"]}',
               "random_seed must be an integer in [0, 2**64 - 1]": b'{"prompts": ["a"], "random_seed": %d}' % 2**70,
               "prompt 0 has 1 token: with tokens_to_generate 32": b'{"prompts": ["A"], "tokens_to_generate": 32}'}
    for reason, data in hostile.items():
        status, text = put_bytes(url, data)
        assert status == 400 and reason in text, (reason, status, text[:300])
    status, text = put(url, {"prompts": ["Rome"], "tokens_to_generate": NEW_TOKENS, "temperature": 1e-300})
    assert status == 200 and json.loads(text)["text"] == [greedy_rome], text
    status, text = put(url, {"prompts": ["Rome"], "tokens_to_generate": 2, "random_seed": 2**64 - 1})
    assert status == 200, text


def test_server_answers_refuses_and_stops(trained):
    data, save = trained
    flags = [SERVER, "--load", save, *model_flags(data), "--tensor-model-parallel-size", "1",
             "--pipeline-model-parallel-size", "2", "--port", "0", "--host", "127.0.0.1"]
    job = Job([(torchrun_command(2) + flags, {})], timeout=180)
    try:
        job.wait_for(r"listening on http://127\.0\.0\.1:\d+/api")
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+/api)", job.text())[1]
        model = load_gpt_model(open_checkpoint(checkpoint_path(save)))
        tokenizer = GPT2BPETokenizer(data.vocab_file, data.merge_file)

        def greedy(prompt):
            return put(url, {"prompts": [prompt], "tokens_to_generate": NEW_TOKENS, "top_k": 1, "logprobs": True})

        with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
            answers = list(pool.map(greedy, PROMPTS))
        for prompt, (status, body) in zip(PROMPTS, answers):
            assert status == 200, body
            answer = json.loads(body)
            text, logprobs = greedy_text(model, tokenizer, prompt)
            assert answer["text"] == [text]
            assert answer["logprobs"][0] == pytest.approx(logprobs, abs=1e-4)
            assert len(answer["segments"][0]) == len(logprobs) + 1  # one segment a token

        refusals = {"prompts argument required": {"tokens_to_generate": 4},
                    "prompts is not a list of strings": {"prompts": "just text"},
                    "cannot set both top_k and top_p": {"prompts": ["a"], "top_k": 5, "top_p": 0.5},
                    "temperature must be a number in (0, 100]": {"prompts": ["a"], "temperature": 0},
                    "tokens_to_generate must be an integer >= 0": {"prompts": ["a"], "tokens_to_generate": "8"},
                    "longer than the model's 32 positions": {"prompts": ["word " * SEQ_LENGTH],
                                                             "tokens_to_generate": 1}}
        for reason, body in refusals.items():
            status, text = put(url, body)
            assert status == 400 and reason in text, (reason, status, text)

        check_hostile_requests(url, greedy_text(model, tokenizer, "Rome")[0])
        sampled = {"prompts": ["The", "In"], "tokens_to_generate": 5, "top_p": 0.9, "random_seed": 7}
        first, again = put(url, sampled), put(url, sampled)
        assert first[0] == 200 and first == again
        client = run_command([sys.executable, CLIENT, url.removeprefix("http://").removesuffix("/api"),
                              "--prompt", "Rome", "--tokens", str(NEW_TOKENS), "--top_k", "1"], timeout=60)
        client.assert_ok()
        assert f"Megatron Response: {greedy_text(model, tokenizer, 'Rome')[0]}" in client.output
        workers = workers_by_local_rank(job.processes[0].pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[0], signal.SIGTERM)
        assert job.wait() == [0], job.text()[-3000:]
    except BaseException:
        kill_job_and_workers(job)
        raise
    assert "> text generation server stopped" in job.text() and "Traceback" not in job.text(), job.text()[-3000:]
