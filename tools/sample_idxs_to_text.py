"""The text of the training samples a range of iterations (or of consumed-sample numbers) read: the data
behind a loss spike.

    python tools/sample_idxs_to_text.py <the run's data and length flags> \
        --tokenizer-type GPT2BPETokenizer --vocab-file tok/vocab.json --merge-file tok/merges.txt \
        --iteration-range 1200 1201 [--rampup-batch-size 32 32 2_000_000] [--print-tokens] [--output-file F]

Give exactly the data flags of the run (``--data-path``/``--split`` or the weighted split paths,
``--seq-length``, ``--seed``, ``--data-cache-path``) and its length flags (``--train-iters`` or
``--train-samples``, ``--global-batch-size``, ``--eval-interval``, ``--eval-iters``): the training
dataset is then the run's, its index caches are reused, and sample n is the n-th the run consumed
(``--dataloader-type single``, the default: the training samples are read in order, whatever the
data-parallel layout). Iteration k read the samples [c(k-1), c(k)) with c(k) the samples consumed
after k iterations: k x global batch, or the sums of the ramp with --rampup-batch-size.

``--sample-id-range START END`` (Megatron-DeepSpeed's flag) takes consumed-sample numbers instead,
END excluded. Each sample prints its number, its iteration and its text (``--print-text``, the
default) and/or token ids (``--print-tokens``); its s + 1 tokens (the last one is only a label) with
``--all-tokens``, else the s the model reads.
"""
import bisect
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.tokenizer import SUPPORTED_TOKENIZER_TYPES, TokenizerError, build_tokenizer  # noqa: E402
from megatron.training.argument_types import parse_int  # noqa: E402
from megatron.training.microbatches import BatchSizeError, build_num_microbatches_calculator  # noqa: E402
from tools.build_dataset_indices import check_run_length, run_data_parser, run_datasets  # noqa: E402


def parse_args(argv=None):
    parser = run_data_parser(__doc__.splitlines()[0])
    tokenizer = parser.add_argument_group("tokenizer")
    tokenizer.add_argument("--tokenizer-type", choices=SUPPORTED_TOKENIZER_TYPES, default="GPT2BPETokenizer")
    tokenizer.add_argument("--vocab-file", default=None)
    tokenizer.add_argument("--merge-file", default=None)
    tokenizer.add_argument("--tokenizer-name-or-path", default=None)
    tokenizer.add_argument("--tokenizer-model", default=None,
                           help="SentencePiece .model, or tokenizer.json (or its directory)")
    which = parser.add_argument_group("samples").add_mutually_exclusive_group(required=True)
    which.add_argument("--iteration-range", type=parse_int, nargs=2, metavar=("FIRST", "LAST"),
                       help="the samples of iterations FIRST..LAST (both included, 1-based)")
    which.add_argument("--sample-id-range", type=parse_int, nargs=2, metavar=("START", "END"),
                       help="consumed-sample numbers START..END-1")
    output = parser.add_argument_group("output")
    output.add_argument("--rampup-batch-size", type=parse_int, nargs=3, default=None,
                        metavar=("START", "INCREMENT", "RAMP_SAMPLES"), help="the run's batch-size rampup")
    output.add_argument("--print-text", action="store_true", help="print each sample's text (the default)")
    output.add_argument("--print-tokens", action="store_true", help="print each sample's token ids")
    output.add_argument("--all-tokens", action="store_true", help="the s + 1 tokens of a sample, not the s read")
    output.add_argument("--output-file", default=None, help="write here (atomically) instead of stdout")
    args = parser.parse_args(argv)
    check_run_length(parser, args)
    return parser, args


def consumed_boundaries(args, iterations: int | None = None, until_sample: int | None = None) -> list[int]:
    """[c(0), c(1), ...]: the samples consumed after each iteration (module docstring), for ``iterations``
    iterations, or until c(k) passes ``until_sample``."""
    calculator = build_num_microbatches_calculator(args.global_batch_size, 1, 1, args.rampup_batch_size)
    boundaries = [0]
    while (len(boundaries) - 1 < iterations) if iterations is not None else (boundaries[-1] <= until_sample):
        calculator.update(boundaries[-1])
        boundaries.append(boundaries[-1] + calculator.get_current_global_batch_size())
    return boundaries


def sample_range(parser, args) -> tuple[int, int]:
    """[start, end) of consumed-sample numbers to print."""
    if args.sample_id_range is not None:
        start, end = args.sample_id_range
        if not 0 <= start < end:
            parser.error(f"--sample-id-range {start} {end}: need 0 <= START < END")
        return start, end
    first, last = args.iteration_range
    if not 1 <= first <= last:
        parser.error(f"--iteration-range {first} {last}: need 1 <= FIRST <= LAST")
    try:
        boundaries = consumed_boundaries(args, iterations=last)
    except BatchSizeError as exc:
        parser.error(str(exc))
    return boundaries[first - 1], boundaries[last]


def describe_samples(dataset, tokenizer, start: int, end: int, args) -> str:
    boundaries = consumed_boundaries(args, until_sample=end)
    parts = []
    for sample in range(start, end):
        tokens = dataset[sample]["text"].tolist()
        tokens = tokens if args.all_tokens else tokens[:-1]
        iteration = bisect.bisect_right(boundaries, sample)  # c(k - 1) <= sample < c(k)
        parts.append(f"=== sample {sample} (iteration {iteration}, {len(tokens)} tokens) ===")
        if args.print_tokens:
            parts.append(" ".join(map(str, tokens)))
        if args.print_text or not args.print_tokens:
            parts.append(tokenizer.detokenize(tokens))
    return "\n".join(parts) + "\n"


def write(text: str, path: str | None) -> None:
    """``text`` to stdout, or to ``path`` through a temporary file renamed when complete; an OSError
    (no such directory, read-only, full) exits with one line naming ``path``, leaving nothing there."""
    if path is None:
        sys.stdout.write(text)
        return
    temporary = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(path)), prefix=".samples_",
                                         delete=False) as f:
            temporary = f.name
            f.write(text)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None and os.path.exists(temporary):
            os.remove(temporary)
        sys.exit(f"error: --output-file {path}: cannot write it: {error.strerror or error}")


def main(argv=None):
    parser, args = parse_args(argv)
    start, end = sample_range(parser, args)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    tokenizer_name_or_path=args.tokenizer_name_or_path,
                                    tokenizer_model=args.tokenizer_model)
    except TokenizerError as exc:
        parser.error(str(exc))
    datasets, _ = run_datasets(args)
    if datasets.train is None or end > len(datasets.train):
        size = 0 if datasets.train is None else len(datasets.train)
        parser.error(f"the run's training dataset holds {size} samples; samples {start}..{end - 1} are not all in it "
                     f"(are these the run's length flags?)")
    write(describe_samples(datasets.train, tokenizer, start, end, args), args.output_file)


if __name__ == "__main__":
    main()
