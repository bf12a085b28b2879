"""Zero-shot evaluation of a GPT checkpoint, Megatron-DeepSpeed's ``tasks/main.py``:

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --overlapping-eval 32 \\
        --load checkpoints/gpt --no-load-optim --no-load-rng --micro-batch-size 8 <model and tokenizer flags>

``--task WIKITEXT103`` prints the perplexity, its word-level adjustment and the token ratio;
``--task LAMBADA`` (``--strict-lambada`` for whole-word targets) the cloze accuracy. Launched like
training (python for one process; torchrun, deepspeed or srun for several), one process per rank:
the model is the checkpoint's (megatron/training/inference_model.py), under the saved TP and PP
unless --tensor-model-parallel-size / --pipeline-model-parallel-size say otherwise; further processes
are data-parallel replicas, each scoring its share of the samples. The last rank prints the result.
The formulas are in megatron/core/evaluation/zeroshot.py and docs/evaluation.md.
"""
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()

from megatron.core.checkpoint.reader import CheckpointInputError  # noqa: E402
from megatron.core.evaluation.zeroshot import (ACCURACY, LOSS, AccuracyReport, EvaluationInputError,  # noqa: E402
                                               evaluate_samples, perplexity_report, read_lambada, read_wikitext)
from megatron.core.tokenizer import TokenizerError  # noqa: E402
from megatron.training.argument_types import ArgumentError  # noqa: E402
from megatron.training.arguments import report_error_and_exit  # noqa: E402
from megatron.training.dist_utils import print_rank_last, sum_across_group  # noqa: E402
from megatron.training.inference_model import (InferenceModel, InferenceSetupError, load_inference_model,  # noqa: E402
                                               parse_inference_arguments)

INPUT_ERRORS = (EvaluationInputError, InferenceSetupError, CheckpointInputError, TokenizerError, ArgumentError,
                OSError)

TASK_METRICS = {"WIKITEXT103": LOSS, "LAMBADA": ACCURACY}
# Megatron-DeepSpeed's fine-tuning and retrieval tasks: recognised, not built here.
FINETUNING_TASKS = ("RACE", "MNLI", "QQP", "ICT-ZEROSHOT-NQ", "RET-FINETUNE-NQ", "MSDP-PROMPT", "MSDP-EVAL-F1")


def add_task_flags(parser) -> None:
    """Megatron-DeepSpeed's "tasks" flags that the zero-shot GPT tasks read."""
    group = parser.add_argument_group("tasks")
    group.add_argument("--task", required=True, help="WIKITEXT103 (perplexity) or LAMBADA (cloze accuracy)")
    group.add_argument("--valid-data", nargs="*", default=None,
                       help="the evaluation file: WikiText-103 text (wiki.test.tokens) or LAMBADA jsonl")
    group.add_argument("--overlapping-eval", type=int, default=32,
                       help="WIKITEXT103: a window starts every N tokens and scores only its last N predictions "
                            "(1 <= N <= --seq-length; N = --seq-length means no overlap)")
    group.add_argument("--strict-lambada", action="store_true",
                       help="LAMBADA: the target is the whole last word, not only its last token")


def check_task_flags(flags, micro_batch_size: int | None) -> str:
    """The evaluation file of the task flags (``add_task_flags``'); raises EvaluationInputError naming
    the flag (before any process group starts). ``micro_batch_size``: --micro-batch-size."""
    if flags.task in FINETUNING_TASKS:
        raise EvaluationInputError(f"--task {flags.task}: fine-tuning tasks are not built here; the zero-shot "
                                   f"tasks are {', '.join(TASK_METRICS)}")
    if flags.task not in TASK_METRICS:
        raise EvaluationInputError(f"--task {flags.task!r} is unknown; use one of {', '.join(TASK_METRICS)}")
    if not flags.valid_data or len(flags.valid_data) != 1:
        raise EvaluationInputError(f"--task {flags.task} reads exactly one file: give --valid-data PATH")
    if not micro_batch_size:
        raise EvaluationInputError("give --micro-batch-size, the samples of one forward")
    return flags.valid_data[0]


def evaluate_task(flags, micro_batch_size: int, logits_fn, tokenizer, seq_length: int, dp_rank: int = 0,
                  dp_size: int = 1, sum_over_replicas=lambda values: values) -> AccuracyReport:
    """The report of ``flags.task`` on ``flags.valid_data``, ``micro_batch_size`` samples a forward: this
    data-parallel replica scores samples dp_rank, dp_rank + dp_size, ...; ``sum_over_replicas`` adds
    the replicas' totals."""
    path = check_task_flags(flags, micro_batch_size)
    if flags.task == "WIKITEXT103":
        samples = read_wikitext(path, tokenizer, seq_length, flags.overlapping_eval)
    else:
        samples = read_lambada(path, tokenizer, seq_length, flags.strict_lambada)
    metric = TASK_METRICS[flags.task]
    mine = range(dp_rank, len(samples), dp_size)
    total, = sum_over_replicas([evaluate_samples(logits_fn, samples, micro_batch_size, metric, mine)])
    if metric == LOSS:
        return perplexity_report(total, samples)
    return AccuracyReport(round(total), len(samples))


def evaluate_loaded(model: InferenceModel, flags) -> AccuracyReport:
    """``flags.task`` (the task flags) on the loaded model, the samples split over its data-parallel
    replicas; collective."""
    groups = model.groups

    def sum_over_replicas(values):
        return sum_across_group(values, group=groups.dp) if groups.dp_size > 1 else values

    return evaluate_task(flags, model.config.micro_batch_size, model.logits, model.tokenizer, model.seq_length,
                         groups.dp_rank, groups.dp_size, sum_over_replicas)


def main(argv=None) -> int:
    """Run the task; the last rank prints Megatron's result line. Exit status 2 on a bad flag or input file."""
    try:
        arguments = parse_inference_arguments(argv, add_task_flags)
        check_task_flags(arguments.tool, arguments.flags.micro_batch_size)
        model = load_inference_model(arguments)
        report = evaluate_loaded(model, arguments.tool)
    except INPUT_ERRORS as error:
        report_error_and_exit(error, 2)
    print_rank_last(report.line(arguments.tool.task))
    model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
