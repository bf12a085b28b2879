"""An HTTP text generation server on a training checkpoint, with Megatron-LM's ``PUT /api``.

    python tools/run_text_generation_server.py --load CKPT <tokenizer flags> [--port 5000] [--host 127.0.0.1]
    torchrun --nproc_per_node 4 tools/run_text_generation_server.py ...   (TP x PP as saved)
    curl -X PUT http://127.0.0.1:5000/api -H 'Content-Type: application/json' \\
         -d '{"prompts": ["Hello"], "tokens_to_generate": 32, "top_p": 0.9}'

Request (JSON object): ``prompts`` (a non-empty list of strings, at most 128), ``tokens_to_generate``
(int >= 0, default 64), ``temperature`` (0 < T <= 100, default 1.0), ``top_k`` (0 .. 1000, default 0 =
off; 1 = greedy), ``top_p`` (0 .. 1, default 0 = off; not with top_k), ``logprobs`` (bool, default
false), ``random_seed`` (int in [0, 2**64 - 1]: this request's draws from a generator of that seed;
else the server's generator, seeded with --seed at the start, goes on). Prompts are Unicode text (a
lone surrogate such as ``"\\ud800"`` is refused). A prompt's tokens plus ``tokens_to_generate`` must
fit in --seq-length. A tiny temperature draws as greedy does (the limit T -> 0).

Answer: ``text`` (prompt and continuation of each prompt, in order), ``segments`` (the text of each
token), with ``logprobs`` the log-probability of each token given the ones before it (from the second
token on; softmax over the tokenizer's vocabulary). A bad request (not JSON, too deeply nested, a
field out of range) gets status 400 and the reason as the body, and the server goes on serving; so
does an unexpected error while generating (status 500, its traceback on stderr).

Global rank 0 runs the HTTP server (threads only queue requests and wait for their answer); its
main thread takes the requests one at a time, shares each with the other ranks, which follow it in
a loop, and all ranks generate it together. SIGTERM or SIGINT stops it cleanly: the request under
way is finished, the other ranks are told to stop, the process group is torn down, exit status 0.
Under torchrun, Ctrl-C also reaches torchrun itself, which prints a SignalException traceback and
exits 1 after the ranks have stopped cleanly; ``kill -TERM`` (or ``-INT``) on the rank-0 process
stops all ranks the same way and torchrun then exits 0 quietly.
"""
import json
import os
import queue
import signal
import sys
import threading
import traceback
from dataclasses import dataclass

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()

import torch  # noqa: E402

from megatron.core.checkpoint.reader import CheckpointInputError  # noqa: E402
from megatron.core.text_generation.generation import GenerationInputError  # noqa: E402
from megatron.core.text_generation.sampling import SamplingParams  # noqa: E402
from megatron.core.tokenizer import TokenizerError, prompt_tokens  # noqa: E402
from megatron.training.argument_types import ArgumentError  # noqa: E402
from megatron.training.arguments import report_error_and_exit  # noqa: E402
from megatron.training.dist_utils import broadcast_object_from_rank_0, is_rank_0, print_rank_0  # noqa: E402
from megatron.training.inference_model import (InferenceSetupError, load_inference_model,  # noqa: E402
                                               parse_inference_arguments)
from megatron.training.signals import exit_without_finalization  # noqa: E402

MAX_PROMPTS = 128
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]
STOP = None  # what rank 0 shares with the other ranks to end their loop


class RequestError(ValueError):
    """A request the server refuses (status 400); the message is the reason."""


@dataclass(frozen=True)
class GenerationRequest:
    prompts: list[str]
    tokens_to_generate: int
    params: SamplingParams
    logprobs: bool
    random_seed: int | None


def add_server_args(parser) -> None:
    group = parser.add_argument_group("text generation server")
    group.add_argument("--port", type=int, default=5000, help="HTTP port of the server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")


def _field(body: dict, name: str, kinds: tuple, default, check, rule: str):
    """body[name] (or ``default``) if it is of one of ``kinds`` (an int passes for a float; a bool never
    for a number) and ``check`` accepts it; else RequestError naming the field and ``rule``."""
    value = body.get(name, default)
    if float in kinds and type(value) is int:
        value = float(value)
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds) or not check(value):
        raise RequestError(f"{name} must be {rule}, got {value!r}")
    return value


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _check_unicode(prompt: str, index: int) -> None:
    """JSON may spell a lone surrogate (``"\\ud800"``), which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(f"prompt {index} is not valid Unicode text: {error.reason} at character "
                           f"{error.start}") from None


def parse_body(data: bytes):
    """The JSON value of a request body; RequestError when it is not JSON or nests too deep to parse."""
    try:
        return json.loads(data)
    except RecursionError:
        raise RequestError("the body nests too deeply to parse") from None
    except ValueError as error:
        raise RequestError(f"the body is not JSON: {error}") from None


def parse_request(body, tokenizer, seq_length: int) -> GenerationRequest:
    """The request of a JSON body (module docstring); RequestError names the field and the rule."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if not 0 < len(prompts) <= MAX_PROMPTS:
        raise RequestError(f"prompts must hold 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
    tokens = _field(body, "tokens_to_generate", (int,), 64, lambda v: v >= 0, "an integer >= 0")
    temperature = _field(body, "temperature", (float,), 1.0, lambda v: 0.0 < v <= 100.0, "a number in (0, 100]")
    top_k = _field(body, "top_k", (int,), 0, lambda v: 0 <= v <= 1000, "an integer in [0, 1000]")
    top_p = _field(body, "top_p", (float,), 0.0, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
    if top_k > 0 and top_p > 0.0:
        raise RequestError("cannot set both top_k and top_p")
    logprobs = _field(body, "logprobs", (bool,), False, lambda v: True, "true or false")
    seed = _field(body, "random_seed", (int, type(None)), None, lambda v: v is None or 0 <= v <= MAX_SEED,
                  "an integer in [0, 2**64 - 1]")
    for index, prompt in enumerate(prompts):
        _check_unicode(prompt, index)
        length = len(prompt_tokens(tokenizer, prompt))
        if length + tokens > seq_length:
            raise RequestError(f"prompt {index} has {_count(length, 'token')}: with tokens_to_generate {tokens} "
                               f"that is longer than the model's {seq_length} positions")
    params = SamplingParams(greedy=top_k == 1, temperature=temperature, top_k=top_k, top_p=top_p)
    return GenerationRequest(prompts, tokens, params, logprobs, seed)


def answer(model, request: GenerationRequest, generator: torch.Generator) -> dict:
    """Generate ``request`` (collective: every rank, the same request) and build the JSON answer."""
    if request.random_seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(request.random_seed)
    samples = model.generate_text(request.prompts, request.tokens_to_generate, request.params, generator)
    sequences = [sample.prompt_tokens + sample.tokens for sample in samples]
    result = {"text": [sample.prompt + sample.text for sample in samples],
              "segments": [[model.tokenizer.detokenize([token]) for token in sequence] for sequence in sequences]}
    if request.logprobs:
        result["logprobs"] = model.token_logprobs(sequences)
    return result


class PendingRequest:
    """A request waiting in the queue, and the answer (status, body) its HTTP thread waits for."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.done = threading.Event()
        self.status, self.body = 500, "the server stopped"

    def reply(self, status: int, body) -> None:
        self.status, self.body = status, body
        self.done.set()


def build_app(model, pending: queue.Queue):
    """The Flask application: PUT /api validates and queues, then waits for the main thread's answer."""
    from flask import Flask, jsonify, request

    app = Flask("megatron_text_generation")

    @app.route("/api", methods=["PUT"])
    def api():
        try:
            parsed = parse_request(parse_body(request.get_data()), model.tokenizer, model.seq_length)
        except RequestError as error:
            return str(error), 400
        job = PendingRequest(parsed)
        pending.put(job)
        job.done.wait()
        return (jsonify(job.body), 200) if job.status == 200 else (str(job.body), job.status)

    return app


def serve(model, flags) -> None:
    """Global rank 0: the HTTP thread and the generation loop, until SIGTERM / SIGINT. ``flags``: the tool's."""
    from werkzeug.serving import make_server

    pending: queue.Queue = queue.Queue()
    stopping = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stopping.set())
    server = make_server(flags.host, flags.port, build_app(model, pending), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print_rank_0(f"> text generation server listening on http://{flags.host}:{server.server_port}/api")
    generator = torch.Generator(device=model.device).manual_seed(model.config.seed)
    while not stopping.is_set():
        try:
            job = pending.get(timeout=0.2)
        except queue.Empty:
            continue
        broadcast_object_from_rank_0(job.request)
        try:
            job.reply(200, answer(model, job.request, generator))
        except GenerationInputError as error:
            job.reply(400, str(error))
        except Exception as error:  # a bug must not end the server: every rank meets it, logs it, goes on
            traceback.print_exc()
            job.reply(500, f"generation failed: {type(error).__name__}: {error}")
    broadcast_object_from_rank_0(STOP)
    server.shutdown()
    while not pending.empty():
        pending.get().reply(503, "the server is stopping")
    print_rank_0("> text generation server stopped")


def follow(model) -> None:
    """The other ranks: generate each request rank 0 shares, until it shares STOP. A signal here
    waits for rank 0's STOP, so no rank leaves a collective half done."""
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, signal.SIG_IGN)
    generator = torch.Generator(device=model.device).manual_seed(model.config.seed)
    while (request := broadcast_object_from_rank_0(None)) is not STOP:
        try:
            answer(model, request, generator)
        except GenerationInputError:
            pass  # rank 0 meets the same error and answers it
        except Exception:
            traceback.print_exc()


def main(argv=None) -> int:
    try:
        arguments = parse_inference_arguments(argv, add_server_args)
        model = load_inference_model(arguments)
    except (InferenceSetupError, CheckpointInputError, TokenizerError, ArgumentError, OSError) as error:
        report_error_and_exit(error, 2)
    if is_rank_0():
        serve(model, arguments.tool)
    else:
        follow(model)
    model.shutdown()
    return 0


if __name__ == "__main__":
    exit_without_finalization(main() or 0)
