"""One rank of an inference launch for the tests: load_inference_model with the command line's flags,
then the logits of the token rows in --tokens-json, written by every rank r to <--output>.<r> (torch file)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()

import torch  # noqa: E402

from megatron.training.inference_model import load_inference_model, parse_inference_arguments  # noqa: E402


def add_flags(parser):
    parser.add_argument("--tokens-json", required=True)
    parser.add_argument("--output", required=True)


def main():
    arguments = parse_inference_arguments(sys.argv[1:], add_flags)
    model = load_inference_model(arguments)
    with open(arguments.tool.tokens_json) as f:
        tokens = torch.tensor(json.load(f), dtype=torch.long)
    logits = model.logits(tokens)
    torch.save({"logits": logits.cpu(), "stage_layers": list(model.forward.stage.layer_indices)},
               f"{arguments.tool.output}.{model.groups.global_rank}")
    model.shutdown()


if __name__ == "__main__":
    main()
