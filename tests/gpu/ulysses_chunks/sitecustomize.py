"""Benchmarks only: DeepSpeed-Ulysses' exchange set in each trainer rank by the environment, so that
``tests/gpu/run_trainer.sh`` can compare settings without a flag (``megatron.core.models.gpt.ulysses``):
``ULYSSES_CHUNKS=N`` pipelines the exchange in N chunks whatever the heads per attention call
(``ulysses_s2_32k_c<N>``), ``ULYSSES_EXCHANGE=peer`` sends it through peer memory (``.._peer``). Fewer
chunks give each attention call more heads; more chunks hide more of the all-to-alls."""
import os

if "LOCAL_RANK" in os.environ and (os.environ.get("ULYSSES_CHUNKS") or os.environ.get("ULYSSES_EXCHANGE")):
    from megatron.core.models.gpt import ulysses

    if os.environ.get("ULYSSES_CHUNKS"):
        ulysses.MAX_CHUNKS, ulysses.MIN_HEADS_PER_CALL = int(os.environ["ULYSSES_CHUNKS"]), 1
    ulysses.EXCHANGE = os.environ.get("ULYSSES_EXCHANGE", ulysses.EXCHANGE)
