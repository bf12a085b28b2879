"""Megatron-style 3D-parallel GPT pretraining on DeepSpeed."""

__version__ = "0.1.0"
