"""DeepSpeed's activation checkpointing on our RNG tracker."""
from megatron.core.tensor_parallel import get_rng_tracker
from megatron.training.engine.replacements import replace


def share_rng_tracker() -> None:
    """Make DeepSpeed's activation checkpointing save and replay megatron.core's tracker.

    ``deepspeed.checkpointing.checkpoint`` (also the default checkpoint function of a
    ``PipelineModule``) snapshots its own module-level tracker; pointing it at ours makes its
    recomputation draw the same model-parallel dropout masks as the first forward.
    """
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing  # slow import

    replace("activation_checkpointing.share_rng_tracker", ds_checkpointing, "_CUDA_RNG_STATE_TRACKER",
            get_rng_tracker())
