"""One rank of a tasks/main.py launch for the tests: the checkpoint's model loaded once with the
command's flags (load_inference_model, add_task_flags), then WIKITEXT103 on --valid-data and plain
and strict LAMBADA on --lambada-data, each through tasks/main.py's evaluate_loaded; global rank 0
writes the figures, unrounded, as JSON to --output."""
import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()

from megatron.training.dist_utils import is_rank_0  # noqa: E402
from megatron.training.inference_model import load_inference_model, parse_inference_arguments  # noqa: E402
from tasks.main import add_task_flags, evaluate_loaded  # noqa: E402


def add_flags(parser):
    add_task_flags(parser)
    parser.add_argument("--lambada-data", required=True)
    parser.add_argument("--output", required=True)


def main():
    arguments = parse_inference_arguments(sys.argv[1:], add_flags)
    model = load_inference_model(arguments)
    flags = arguments.tool
    lambada = {"task": "LAMBADA", "valid_data": [flags.lambada_data]}
    figures = {name: dataclasses.asdict(evaluate_loaded(model, argparse.Namespace(**{**vars(flags), **changes})))
               for name, changes in (("WIKITEXT103", {}), ("LAMBADA", lambada),
                                     ("LAMBADA strict", {**lambada, "strict_lambada": True}))}
    if is_rank_0():
        with open(flags.output, "w") as f:
            json.dump(figures, f)
    model.shutdown()


if __name__ == "__main__":
    main()
