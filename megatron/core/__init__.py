"""The library: parallel layers, models, kernels, datasets, tokenizers and checkpoint formats.

Nothing in ``megatron.core`` imports ``megatron.training`` or reads command-line arguments; callers
pass typed configuration objects and process groups explicitly.
"""
