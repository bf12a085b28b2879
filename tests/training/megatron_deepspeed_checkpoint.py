"""pretrain_gpt.py whose checkpoints are written as Megatron-DeepSpeed (BigScience's fork) writes them.

A fixture for the tests that resume such checkpoints. Two pieces of that trainer replace ours in this
process, reproduced from its code (megatron/checkpointing.py ``save_checkpoint`` with --deepspeed,
megatron/optimizer/__init__.py ``_get_params_for_weight_decay_optimization``):

  - the optimizer's parameter groups: the weight-decay parameters split in two halves, then the
    biases and norm weights (three groups; same updates as our two, other flat ZeRO partitions);
  - the LR schedule's state: AnnealingLR.state_dict's eight keys (megatron/learning_rates.py), none of
    ours added;
  - the parameter names where they differ from ours: the embedding LayerNorm (--embed-layernorm) is
    ``word_embeddings.norm.*`` there, in the layer files, the partitions' ``param_slice_mappings`` and
    the model-states files' ``param_shapes``;
  - the save: the client state ``args`` (an argparse.Namespace, pickled whole, with the counters
    consumed_train_samples, consumed_valid_samples, consumed_train_tokens, gigaflos_no_embeds and
    position_embedding_type as megatron.enums.PositionEmbeddingType), ``checkpoint_version`` 3.0,
    ``iteration``, ``tokens``, ``checkpoint_info`` and the five RNG entries, handed to
    ``engine.save_checkpoint(args.save, client_state=state_dict)`` with DeepSpeed's default tag and
    ``latest``: no manifest, no latest_checkpointed_iteration.txt, no commit protocol.

The Namespace holds every flag of our parser (Megatron-DeepSpeed's names) and what its parse_args and
training loop add. Without CUDA, ``cuda_rng_state`` and the tracker's states (CUDA generator states
there) are the CPU generator's states, the nearest stand-in.
"""
import argparse
import collections
import contextlib
import enum
import os
import random
import runpy
import sys
import types

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PositionEmbeddingType(enum.Enum):
    """megatron/enums.py of Megatron-DeepSpeed, pickled under its module name."""

    rotary = 1
    absolute = 2
    alibi = 3


def foreign_enums_module() -> types.ModuleType:
    """A ``megatron.enums`` module holding the class above, as pickle must find it by its module."""
    module = types.ModuleType("megatron.enums")
    PositionEmbeddingType.__module__ = "megatron.enums"
    module.PositionEmbeddingType = PositionEmbeddingType
    return module


def three_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Megatron-DeepSpeed's groups: the weight-decay parameters in two halves, then the others. Its
    Adam gets weight_decay as its default; the halves carry it here, our builder passes no default."""
    from megatron.training.engine.model_setup import _is_norm

    decay, no_decay = [], []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            (no_decay if _is_norm(module) or name == "bias" else decay).append(param)
    half = len(decay) // 2
    return [{"params": decay[:half], "weight_decay": weight_decay},
            {"params": decay[half:], "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


SCHEDULER_KEYS = ("max_lr", "warmup_steps", "num_steps", "warmup_tokens", "num_tokens", "decay_style", "decay_steps",
                  "min_lr")


def scheduler_state(scheduler) -> dict:
    """Megatron-DeepSpeed's AnnealingLR.state_dict."""
    return {key: getattr(scheduler, key) for key in SCHEDULER_KEYS}


def megatron_deepspeed_args(progress, config) -> argparse.Namespace:
    """The Namespace its save pickles: the flags, then what its parse_args derives and its loop counts."""
    from megatron.training.arguments import build_parser

    args = build_parser().parse_args(sys.argv[1:])
    model, parallel = config.model, config.parallel
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = parallel.world_size
    args.data_parallel_size = parallel.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    args.virtual_pipeline_model_parallel_size = None
    args.params_dtype = model.params_dtype
    args.ffn_hidden_size, args.kv_channels = model.ffn_hidden_size, model.kv_channels
    args.encoder_seq_length = args.seq_length
    args.padded_vocab_size = model.padded_vocab_size
    args.position_embedding_type = PositionEmbeddingType[model.position_embedding_type]
    args.curriculum_learning = False
    args.deepspeed = True
    args.iteration = progress.iteration
    args.consumed_train_samples = progress.consumed_train_samples
    args.consumed_valid_samples = progress.consumed_valid_samples
    args.consumed_train_tokens = progress.consumed_train_tokens
    args.gigaflos_no_embeds = progress.gigaflos_no_embeddings
    return args


OUR_NAME, THEIR_NAME = "embed_layernorm.", "word_embeddings.norm."


def their_name(name: str) -> str:
    if name.startswith(OUR_NAME) or f".{OUR_NAME}" in name:
        return name.replace(OUR_NAME, THEIR_NAME, 1)
    return name


def _renamed(mapping: dict) -> collections.OrderedDict:
    return collections.OrderedDict((their_name(key), value) for key, value in mapping.items())


def with_their_names(state, path: str):
    """What DeepSpeed writes to ``path``, under Megatron-DeepSpeed's parameter names (copies; the
    engine's own structures stay as they are)."""
    name = os.path.basename(path)
    if name.startswith("layer_"):
        return _renamed(state)
    if name.startswith("mp_rank_") and state.get("param_shapes"):
        return {**state, "param_shapes": [_renamed(group) for group in state["param_shapes"]]}
    if name.endswith("optim_states.pt"):
        optimizer = state["optimizer_state_dict"]
        mappings = [_renamed(group) for group in optimizer["param_slice_mappings"]]
        return {**state, "optimizer_state_dict": {**optimizer, "param_slice_mappings": mappings}}
    return state


@contextlib.contextmanager
def their_file_names(engine):
    writer = engine.checkpoint_engine
    own_save = writer.save
    writer.save = lambda state_dict, path: own_save(with_their_names(state_dict, path), path)
    try:
        yield
    finally:
        writer.save = own_save


def _cuda_or_cpu_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def save_checkpoint(adapter, progress, config) -> None:
    """Megatron-DeepSpeed's save_checkpoint on the DeepSpeed path, step for step, on the DeepSpeed
    engine inside the trainer's adapter (megatron/training/engine/deepspeed_engine.py)."""
    from megatron.core.tensor_parallel import get_rng_tracker
    from megatron.training.dist_utils import barrier, print_rank_0

    engine = adapter.engine
    args = megatron_deepspeed_args(progress, config)
    iteration = progress.iteration
    print_rank_0('saving checkpoint at iteration {:7d} to {}'.format(iteration, args.save))
    state_dict = {}
    state_dict['args'] = args
    state_dict['checkpoint_version'] = 3.0
    state_dict['iteration'] = iteration
    state_dict['tokens'] = args.consumed_train_tokens
    state_dict['checkpoint_info'] = {"padded_vocab_size": args.padded_vocab_size,
                                     "original_vocab_size": config.data.orig_vocab_size}
    if not args.no_save_rng:
        state_dict['random_rng_state'] = random.getstate()
        state_dict['np_rng_state'] = np.random.get_state()
        state_dict['torch_rng_state'] = torch.get_rng_state()
        state_dict['cuda_rng_state'] = _cuda_or_cpu_state()
        state_dict['rng_tracker_states'] = {
            name: streams.cuda if streams.cuda is not None else streams.cpu
            for name, streams in get_rng_tracker().get_states().items()}
    with their_file_names(engine):
        engine.save_checkpoint(args.save, client_state=state_dict)
    barrier()
    print_rank_0('  successfully saved checkpoint at iteration {:7d} to {}'.format(iteration, args.save))


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from megatron.training.initialize import select_accelerator

    select_accelerator()
    sys.modules["megatron.enums"] = foreign_enums_module()
    from megatron.training import lr_schedule, training
    from megatron.training.engine import model_setup as engine_module

    engine_module.weight_decay_groups = three_groups
    lr_schedule.AnnealingLR.state_dict = scheduler_state
    training.save_checkpoint = save_checkpoint
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
