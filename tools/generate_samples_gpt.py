"""Generate text from a training checkpoint, with Megatron-DeepSpeed's flags.

    python tools/generate_samples_gpt.py --load CKPT <model and tokenizer flags> \\
        --sample-input-file prompts.txt [--sample-output-file out.txt] [--genfile out.jsonl] \\
        --out-seq-length 64 [--greedy | --temperature T --top_k K --top_p P] [--recompute] [--seed S]
    torchrun --nproc_per_node 4 tools/generate_samples_gpt.py ... (TP x PP as saved, one process a rank)

Modes:
    --num-samples N (N > 0)    N unconditional samples (each starts from the end-of-document token),
                               written to --genfile
    --sample-input-file F      one prompt a line; each prompt and its continuation in Megatron's text
                               form ("\\nContext:" prompt "\\n\\nMegatron-LM:" continuation "\\n") to
                               --sample-output-file (default F.out), and to --genfile when given
    neither                    interactive: prompts typed at "Context prompt (stop to exit) >>> "

--genfile holds one JSON object a sample: ``prompt``, ``text`` (the continuation) and ``tokens``
(its ids, the end-of-document token included when the model ended there). --out-seq-length is the
number of new tokens (also bounded by --seq-length). Prompts go --micro-batch-size at a time (1 by
default). Sampling: greedy with --greedy, else softmax(logits / --temperature) filtered by --top_k
and --top_p, drawn from a generator seeded with --seed. --recompute runs without the key/value
cache (each step recomputes the whole prefix), the reference of the cached path.
"""
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()

import torch  # noqa: E402

from megatron.core.checkpoint.reader import CheckpointInputError  # noqa: E402
from megatron.core.text_generation.generation import GenerationInputError  # noqa: E402
from megatron.core.text_generation.sampling import SamplingError, SamplingParams  # noqa: E402
from megatron.core.tokenizer import TokenizerError  # noqa: E402
from megatron.training.argument_types import ArgumentError  # noqa: E402
from megatron.training.arguments import report_error_and_exit  # noqa: E402
from megatron.training.dist_utils import broadcast_object_from_rank_0, is_rank_0  # noqa: E402
from megatron.training.inference_model import (InferenceSetupError, load_inference_model,  # noqa: E402
                                               parse_inference_arguments)
from megatron.training.signals import exit_without_finalization  # noqa: E402

INPUT_ERRORS = (InferenceSetupError, CheckpointInputError, TokenizerError, ArgumentError, SamplingError,
                GenerationInputError, OSError)
INTERACTIVE_PROMPT = "Context prompt (stop to exit) >>> "


def add_text_generate_args(parser) -> None:
    """Megatron-DeepSpeed's text generation flags."""
    group = parser.add_argument_group("text generation")
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    group.add_argument("--greedy", action="store_true", help="take the most likely token (no sampling)")
    group.add_argument("--top_p", type=float, default=0.0, help="top-p (nucleus) filter; 0 = off")
    group.add_argument("--top_k", type=int, default=0, help="top-k filter; 0 = off")
    group.add_argument("--out-seq-length", type=int, default=1024, help="new tokens to generate at most")
    group.add_argument("--sample-input-file", default=None, help="prompts, one a line")
    group.add_argument("--sample-output-file", default=None, help="output of --sample-input-file (default <input>.out)")
    group.add_argument("--num-samples", type=int, default=0, help="unconditional samples (0: prompts from a file "
                                                                  "or typed in)")
    group.add_argument("--genfile", default=None, help="JSON lines output: prompt, text, tokens of each sample")
    group.add_argument("--recompute", action="store_true", help="no key/value cache: recompute every step")


def sampling_params(flags) -> SamplingParams:
    if flags.out_seq_length < 1:
        raise SamplingError(f"--out-seq-length {flags.out_seq_length}: must be >= 1")
    return SamplingParams(greedy=flags.greedy, temperature=flags.temperature, top_k=flags.top_k, top_p=flags.top_p)


def check_mode(flags) -> None:
    """The mode's files: --num-samples needs --genfile; the input file must be readable."""
    if flags.num_samples < 0:
        raise ArgumentError(f"--num-samples {flags.num_samples}: must be >= 0")
    if flags.num_samples > 0 and not flags.genfile:
        raise ArgumentError(f"--num-samples {flags.num_samples} writes its samples to --genfile: give --genfile PATH")
    if flags.num_samples == 0 and flags.sample_input_file and not os.path.isfile(flags.sample_input_file):
        raise ArgumentError(f"--sample-input-file {flags.sample_input_file}: no such file")


def read_prompts(path: str) -> list[str]:
    """The lines of ``path`` (newline stripped); an empty line is an error naming it."""
    with open(path, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f]
    for number, prompt in enumerate(prompts, start=1):
        if not prompt.strip():
            raise GenerationInputError(f"{path}:{number}: empty prompt")
    return prompts


class Writers:
    """The output files, open on global rank 0 only (every rank computes the same samples)."""

    def __init__(self, text_path: str | None, genfile: str | None):
        self.text = open(text_path, "w", encoding="utf-8") if text_path and is_rank_0() else None
        self.json = open(genfile, "w", encoding="utf-8") if genfile and is_rank_0() else None

    def write(self, sample) -> None:
        if self.text is not None:
            self.text.write(f"\nContext:{sample.prompt}\n\nMegatron-LM:{sample.text}\n")
        if self.json is not None:
            self.json.write(json.dumps({"prompt": sample.prompt, "text": sample.text, "tokens": sample.tokens}) + "\n")

    def close(self) -> None:
        for handle in (self.text, self.json):
            if handle is not None:
                handle.close()


def generate_batches(model, prompts: list[str], flags, params, generator, writers) -> None:
    """Prompts --micro-batch-size at a time; every sample printed (rank 0) and written; ``flags``: the tool's."""
    batch_size = model.config.micro_batch_size or 1
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        for sample in model.generate_text(batch, flags.out_seq_length, params, generator, use_cache=not flags.recompute):
            if is_rank_0():
                print(f"\nContext:{sample.prompt}\n\nMegatron-LM:{sample.text}", flush=True)
            writers.write(sample)


def read_interactive_prompt() -> str | None:
    """Rank 0 asks until it gets a non-empty prompt; None at "stop" or the end of input; shared with all ranks."""
    prompt = None
    if is_rank_0():
        while True:
            try:
                prompt = input(INTERACTIVE_PROMPT)
            except EOFError:
                prompt = None
                break
            if prompt.strip():
                break
            print("Prompt should not be empty!", flush=True)
        prompt = None if prompt is not None and prompt.strip() == "stop" else prompt
    return broadcast_object_from_rank_0(prompt)


def run_interactive(model, flags, params, generator, writers) -> None:
    while (prompt := read_interactive_prompt()) is not None:
        try:
            generate_batches(model, [prompt], flags, params, generator, writers)
        except GenerationInputError as error:
            if is_rank_0():
                print(f"error: {error}", flush=True)


def run(model, flags) -> None:
    """The mode of the tool's ``flags`` on the loaded model."""
    params = sampling_params(flags)
    generator = torch.Generator(device=model.device).manual_seed(model.config.seed)
    if flags.num_samples > 0:
        writers = Writers(None, flags.genfile)
        prompts = [""] * flags.num_samples
    elif flags.sample_input_file:
        writers = Writers(flags.sample_output_file or flags.sample_input_file + ".out", flags.genfile)
        prompts = read_prompts(flags.sample_input_file)
    else:
        writers = Writers(None, flags.genfile)
        prompts = None
    try:
        if prompts is None:
            run_interactive(model, flags, params, generator, writers)
        else:
            generate_batches(model, prompts, flags, params, generator, writers)
    finally:
        writers.close()


def main(argv=None) -> int:
    """Exit status 2 on a bad flag, checkpoint, prompt file or prompt (rank 0 names it)."""
    try:
        arguments = parse_inference_arguments(argv, add_text_generate_args)
        sampling_params(arguments.tool)
        check_mode(arguments.tool)
        model = load_inference_model(arguments)
        run(model, arguments.tool)
    except INPUT_ERRORS as error:
        report_error_and_exit(error, 2)
    model.shutdown()
    return 0


if __name__ == "__main__":
    exit_without_finalization(main() or 0)
