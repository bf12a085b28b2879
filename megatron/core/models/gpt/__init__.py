"""The GPT model: config, embeddings, attention, MLP, transformer layer, GPTModel and pipeline specs.

``GPTModel`` runs the whole model on one pipeline stage; ``GPTModelPipe`` (in ``pipeline``, which
imports DeepSpeed) is the same model as a DeepSpeed PipelineModule.
"""
from megatron.core.models.gpt.config import GPTConfigError, GPTModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel, language_model_loss, masked_token_mean
from megatron.core.models.gpt.masks import LtorMasks, causal_mask, get_ltor_masks_and_position_ids

__all__ = [
    "GPTConfigError",
    "GPTModel",
    "GPTModelConfig",
    "LtorMasks",
    "causal_mask",
    "get_ltor_masks_and_position_ids",
    "language_model_loss",
    "masked_token_mean",
]
