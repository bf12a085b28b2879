"""What the trainer adds to DeepSpeed's ``mp_rank_MM_model_states.pt``: the client state.

    iteration, consumed_train_samples, consumed_train_tokens, consumed_valid_samples,
    gigaflos_no_embeddings, curriculum_seqlen       the TrainingProgress (curriculum_seqlen: the last
                                                    training length, None without curriculum learning)
    tokens                                          = consumed_train_tokens (Megatron-DeepSpeed's key)
    checkpoint_version                              3.0
    checkpoint_info                                 {padded_vocab_size, original_vocab_size}
    args                                            the model, the layout and the whole configuration,
                                                    as plain values (``plain_value``)
    universal_checkpoint_info                       the patterns of DeepSpeed's universal conversion
                                                    (universal.py)

The trainer adds the RNG states unless --no-save-rng, and at ZeRO stage 0 the optimizer's parameter
names. An imported model (no engine saved it) gets the same entries at iteration 0 beside DeepSpeed's
own, empty (``imported_checkpoint_state``).
"""
import dataclasses
from dataclasses import dataclass

from megatron.core.checkpoint.sharding import model_sharding
from megatron.core.checkpoint.universal import UNIVERSAL_CHECKPOINT_INFO, universal_info
from megatron.core.models.gpt.config import GPTModelConfig

CHECKPOINT_VERSION = 3.0
OPTIONAL_PROGRESS_KEYS = ("curriculum_seqlen",)  # absent from checkpoints of runs without a curriculum


@dataclass
class TrainingProgress:
    """Where training stands; saved in every checkpoint and restored on --load."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_train_tokens: int = 0
    consumed_valid_samples: int = 0
    gigaflos_no_embeddings: float = 0.0
    curriculum_seqlen: int | None = None  # the last training length with curriculum learning


def saved_progress(state: dict) -> TrainingProgress:
    """The TrainingProgress of a loaded client state (a KeyError names a missing required entry)."""
    return TrainingProgress(**{f.name: state[f.name] for f in dataclasses.fields(TrainingProgress)
                               if f.name in state or f.name not in OPTIONAL_PROGRESS_KEYS})


def plain_value(value):
    """A value safe to unpickle anywhere and to print: numbers, strings, lists and dicts of them; the
    rest (a torch dtype, ...) as its str."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): plain_value(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value):
        return {f.name: plain_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)


def trainer_entries(progress: TrainingProgress, model: GPTModelConfig, original_vocab_size: int, arguments: dict,
                    pipeline: bool) -> dict:
    """The client state without the RNG states; ``arguments``: the ``args`` entry; ``pipeline``: the
    checkpoint keeps the module in layer files."""
    state = dataclasses.asdict(progress)
    state.update(tokens=progress.consumed_train_tokens, checkpoint_version=CHECKPOINT_VERSION,
                 checkpoint_info={"padded_vocab_size": model.padded_vocab_size,
                                  "original_vocab_size": original_vocab_size},
                 args=arguments)
    state[UNIVERSAL_CHECKPOINT_INFO] = universal_info(model_sharding(model), pipeline=pipeline,
                                                      padded_vocab_size=model.padded_vocab_size,
                                                      original_vocab_size=original_vocab_size)
    return state


def imported_checkpoint_state(model: GPTModelConfig, original_vocab_size: int, tp: int, pp: int, data: dict,
                              ds_version: str) -> dict:
    """The model-states entries of a checkpoint that no engine saved (an imported model), at iteration 0:
    the client state without RNG states, whose ``args`` hold the model, the layout and ``data`` (the
    tokenizer's settings), and DeepSpeed's own entries, empty, as DeepSpeed ``ds_version`` writes them.
    No LR schedule (``lr_scheduler`` None): a run that loads it starts the configured one."""
    arguments = {"model": plain_value(model), "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                 "data_parallel_size": 1, "config": {"model": plain_value(model), "data": data}}
    state = {"module": None, "buffer_names": [], "optimizer": None, "param_shapes": None, "frozen_param_shapes": None,
             "shared_params": None, "frozen_param_fragments": None, "lr_scheduler": None, "data_sampler": None,
             "random_ltd": None, "skipped_steps": 0, "global_steps": 0, "global_samples": 0, "dp_world_size": 1,
             "mp_world_size": tp * pp, "ds_config": {}, "ds_version": ds_version}
    state.update(trainer_entries(TrainingProgress(), model, original_vocab_size, arguments, pipeline=True))
    return state
