"""lm-evaluation-harness tasks on a GPT checkpoint, Megatron-DeepSpeed's ``tasks/eval_harness/evaluate.py``:

    python tasks/eval_harness/evaluate.py --load checkpoints/gpt --micro-batch-size 4 <model and tokenizer flags> \\
        --task_list my_task,lambada_local --include_path my_tasks/ --results_path results.json

Launched like training (python for one process; torchrun, deepspeed or srun for several), one
process per rank: the model is the checkpoint's (megatron/training/inference_model.py), under the
saved TP and PP unless --tensor-model-parallel-size / --pipeline-model-parallel-size say otherwise;
further processes are data-parallel replicas sharing the requests. The adapter is megatron_lm.py.
Global rank 0 prints the tables and writes the results as JSON. Offline use: define the tasks in
local YAML files whose data are local files (``dataset_path: json`` with
``dataset_kwargs.data_files``) and name their directory with ``--include_path``; set
HF_DATASETS_OFFLINE=1. Needs the ``[eval]`` extra (lm-eval).
"""
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()

import torch  # noqa: E402

from megatron.core.evaluation.zeroshot import EvaluationInputError  # noqa: E402
from megatron.training.arguments import report_error_and_exit  # noqa: E402
from megatron.training.dist_utils import gather_objects, is_rank_0  # noqa: E402
from megatron.training.inference_model import (InferenceModel, load_inference_model,  # noqa: E402
                                               parse_inference_arguments)
from tasks.main import INPUT_ERRORS  # noqa: E402


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


def task_manager(flags):
    """The harness's task index (its own tasks and --include_path's); every --task_list name must be in it."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=flags.include_path)
    unknown = [name for name in task_names(flags.task_list) if name not in manager.all_tasks]
    if unknown:
        where = f" nor under --include_path {flags.include_path}" if flags.include_path else ""
        raise EvaluationInputError(f"--task_list: {', '.join(unknown)}: no such task in the harness{where}")
    return manager


def harness_model(model: InferenceModel, flags):
    """The adapter on the loaded model, its data-parallel replicas sharing the requests; ``flags``: the harness's."""
    from tasks.eval_harness.megatron_lm import MegatronLM, Replicas

    groups = model.groups
    replicas = Replicas(groups.dp_rank, groups.dp_size, lambda value: gather_objects(value, group=groups.dp))
    return MegatronLM(model.forward, model.tokenizer, model.seq_length,
                      batch_size=model.config.micro_batch_size * flags.micro_bs_multiplier,
                      adaptive_seq_len=flags.adaptive_seq_len, device=model.device,
                      replicas=replicas if groups.dp_size > 1 else Replicas())


def run_harness(lm, flags, manager) -> dict:
    """simple_evaluate over ``flags.task_list`` (one task at a time with --intermed_results); global
    rank 0 prints the tables and writes ``flags.results_path`` after each; returns the merged results
    there (empty elsewhere)."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import make_table

    merged = {"results": {}, "versions": {}, "n-shot": {}, "configs": {}}
    names = task_names(flags.task_list)
    batches = [[name] for name in names] if flags.intermed_results else [names]
    for batch in batches:
        results = simple_evaluate(model=lm, tasks=batch, task_manager=manager, num_fewshot=flags.num_fewshot,
                                  bootstrap_iters=flags.bootstrap_iters, log_samples=False)
        if results is None or not is_rank_0():  # the harness aggregates only where LOCAL_RANK is 0
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
    """Evaluate; exit status 2 on a bad flag, task or checkpoint (named before any process group starts)."""
    try:
        arguments = parse_inference_arguments(argv, add_harness_flags)
        flags = arguments.tool
        if not arguments.flags.micro_batch_size:
            raise EvaluationInputError("give --micro-batch-size, the requests of one forward")
        manager = task_manager(flags)
        model = load_inference_model(arguments, params_dtype=torch.float32 if flags.eval_fp32 else None)
        run_harness(harness_model(model, flags), flags, manager)
    except INPUT_ERRORS as error:
        report_error_and_exit(error, 2)
    model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
