"""Benchmarks only: ``ULYSSES_MAX_CHUNKS`` caps the chunks of DeepSpeed-Ulysses' pipelined exchange
(``megatron.core.models.gpt.ulysses.MAX_CHUNKS``) in each trainer rank, so that ``tests/gpu/run_trainer.sh``
can compare chunk counts (``ulysses_s2_32k_c<N>``) without a flag. Fewer chunks give each attention call more
heads; more chunks hide more of the all-to-alls."""
import os

if os.environ.get("ULYSSES_MAX_CHUNKS") and "LOCAL_RANK" in os.environ:
    from megatron.core.models.gpt import ulysses

    ulysses.MAX_CHUNKS = int(os.environ["ULYSSES_MAX_CHUNKS"])
