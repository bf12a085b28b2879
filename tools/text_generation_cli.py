"""A small client of tools/run_text_generation_server.py (Megatron-LM's text_generation_cli.py).

    python tools/text_generation_cli.py localhost:5000                  # asks for prompts in a loop
    python tools/text_generation_cli.py localhost:5000 --prompt "Hello" --tokens 32 [--top_p 0.9 ...]

Each prompt is sent as ``PUT /api`` with ``tokens_to_generate`` and the sampling fields given; the
answer's text is printed after "Megatron Response: ". A refused request (status 400) prints the
server's reason and, with --prompt, exits with status 1.
"""
import argparse
import json
import sys
import urllib.error
import urllib.request

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "random_seed")


def put(url: str, body: dict) -> tuple[int, str]:
    """(status, response text) of a PUT of ``body`` as JSON to ``url``."""
    return put_bytes(url, json.dumps(body).encode())


def put_bytes(url: str, data: bytes) -> tuple[int, str]:
    """(status, response text) of a PUT of the raw JSON body ``data`` to ``url``."""
    request = urllib.request.Request(url, data=data, method="PUT", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def ask(url: str, prompt: str, tokens: int, sampling: dict) -> bool:
    """Send one prompt and print the answer (or the refusal); True when answered."""
    status, text = put(url, {"prompts": [prompt], "tokens_to_generate": tokens, **sampling})
    if status != 200:
        print(f"Refused ({status}): {text}", flush=True)
        return False
    print(f"Megatron Response: {json.loads(text)['text'][0]}", flush=True)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the server")
    parser.add_argument("--prompt", default=None, help="send this prompt once and exit (else ask in a loop)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens_to_generate")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--random_seed", type=int, default=None)
    flags = parser.parse_args(argv)
    url = f"http://{flags.address}/api"
    sampling = {name: getattr(flags, name) for name in SAMPLING_FIELDS if getattr(flags, name) is not None}
    if flags.prompt is not None:
        return 0 if ask(url, flags.prompt, flags.tokens, sampling) else 1
    while True:
        try:
            prompt = input("Enter prompt: ")
            tokens = int(input("Enter number of tokens to generate: ") or flags.tokens)
        except (EOFError, KeyboardInterrupt):
            return 0
        except ValueError:
            print("the number of tokens must be an integer", flush=True)
            continue
        ask(url, prompt, tokens, sampling)


if __name__ == "__main__":
    sys.exit(main())
