"""lm-evaluation-harness tasks on a GPT checkpoint, Megatron-DeepSpeed's ``tasks/eval_harness/evaluate.py``:

    python tasks/eval_harness/evaluate.py --load checkpoints/gpt --micro-batch-size 4 <model and tokenizer flags> \\
        --task_list my_task,lambada_local --include_path my_tasks/ --results_path results.json

The model is the checkpoint's, whatever TP and PP saved it, run in this one process
(tasks/checkpoint_model.py); the adapter is megatron_lm.py. The tables are printed and the results
written as JSON. Offline use: define the tasks in local YAML files whose data are
local files (``dataset_path: json`` with ``dataset_kwargs.data_files``) and name their directory
with ``--include_path``; set HF_DATASETS_OFFLINE=1. Needs the ``[eval]`` extra (lm-eval).
"""
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.checkpoint.reader import CheckpointInputError
from megatron.core.evaluation.zeroshot import EvaluationInputError
from megatron.core.tokenizer import TokenizerError
from megatron.training.argument_types import ArgumentError
from megatron.training.inference_model import InferenceSetupError
from tasks.checkpoint_model import load_checkpoint_model


def add_harness_flags(parser) -> None:
    """Megatron-DeepSpeed's harness flags, plus the harness's own --include_path and --num_fewshot."""
    group = parser.add_argument_group("evaluation harness")
    group.add_argument("--task_list", required=True,
                       help="comma-separated harness task or group names (no 'all': name the tasks)")
    group.add_argument("--results_path", default="./results.json", help="where the results are written (JSON)")
    group.add_argument("--adaptive_seq_len", action="store_true",
                       help="pad each batch to its longest input instead of --seq-length")
    group.add_argument("--eval_fp32", action="store_true", help="run the model in fp32 whatever it was saved in")
    group.add_argument("--intermed_results", action="store_true",
                       help="print and write each task's results as soon as it is done")
    group.add_argument("--bootstrap_iters", type=int, default=100000,
                       help="bootstrap resamples for the standard errors (0: none)")
    group.add_argument("--micro_bs_multiplier", type=int, default=1,
                       help="harness batch = --micro-batch-size times this")
    group.add_argument("--include_path", default=None, help="a directory of local task YAML files")
    group.add_argument("--num_fewshot", type=int, default=0, help="examples shown before each question")


def task_names(task_list: str) -> list[str]:
    names = [name.strip() for name in task_list.split(",") if name.strip()]
    if not names:
        raise EvaluationInputError("--task_list names no task")
    if "all" in names:
        raise EvaluationInputError("--task_list all: the harness's full list needs downloads; name the tasks")
    return names


def run_harness(lm, flags) -> dict:
    """simple_evaluate over ``flags.task_list`` (one task at a time with --intermed_results), the
    tables printed and ``flags.results_path`` written after each; returns the merged results."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    manager = TaskManager(include_path=flags.include_path)
    names = task_names(flags.task_list)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        where = f" nor under --include_path {flags.include_path}" if flags.include_path else ""
        raise EvaluationInputError(f"--task_list: {', '.join(unknown)}: no such task in the harness{where}")
    merged = {"results": {}, "versions": {}, "n-shot": {}, "configs": {}}
    batches = [[name] for name in names] if flags.intermed_results else [names]
    for batch in batches:
        results = simple_evaluate(model=lm, tasks=batch, task_manager=manager, num_fewshot=flags.num_fewshot,
                                  bootstrap_iters=flags.bootstrap_iters, log_samples=False)
        if results is None:  # the harness aggregates only where LOCAL_RANK is 0
            continue
        for key in merged:
            merged[key].update(results.get(key, {}))
        print(make_table(results), flush=True)
        write_results(merged, flags.results_path)
    return merged


def write_results(results: dict, path: str) -> None:
    """``results`` as JSON at ``path``, written to a temporary name and renamed."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(temporary, path)


def main(argv=None) -> int:
    """Evaluate; exit status 2 on a bad flag, task or checkpoint."""
    try:
        loaded = load_checkpoint_model(argv, add_harness_flags)
        from tasks.eval_harness.megatron_lm import MegatronLM

        flags = loaded.flags
        lm = MegatronLM(loaded.model, loaded.tokenizer, loaded.seq_length,
                        batch_size=flags.micro_batch_size * flags.micro_bs_multiplier,
                        adaptive_seq_len=flags.adaptive_seq_len)
        run_harness(lm, flags)
    except (EvaluationInputError, InferenceSetupError, CheckpointInputError, TokenizerError, ArgumentError) as exc:
        print(f"tasks/eval_harness/evaluate.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
