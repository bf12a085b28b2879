"""Tests of megatron/training."""
