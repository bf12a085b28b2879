"""Benchmarks only: DeepSpeed-Ulysses' exchange set in each trainer rank by the environment, so that
``tests/gpu/run_trainer.sh`` can compare settings without a flag (``megatron.core.models.gpt.ulysses``):
``ULYSSES_CHUNKS=N`` pipelines the exchange in N chunks whatever the heads per attention call
(``ulysses_s2_32k_c<N>``), ``ULYSSES_EXCHANGE=peer`` sends it through peer memory (``.._peer``),
``ULYSSES_OVERLAP_PROJECTIONS=1`` hides it behind the projections instead (``.._proj``). Fewer chunks give
each attention call more heads; more chunks hide more of the all-to-alls."""
import os

SETTINGS = ("ULYSSES_CHUNKS", "ULYSSES_EXCHANGE", "ULYSSES_OVERLAP_PROJECTIONS")

if "LOCAL_RANK" in os.environ and any(os.environ.get(name) for name in SETTINGS):
    from megatron.core.models.gpt import ulysses

    if os.environ.get("ULYSSES_CHUNKS"):
        ulysses.MAX_CHUNKS, ulysses.MIN_HEADS_PER_CALL = int(os.environ["ULYSSES_CHUNKS"]), 1
    ulysses.EXCHANGE = os.environ.get("ULYSSES_EXCHANGE") or ulysses.EXCHANGE
    ulysses.OVERLAP_PROJECTIONS = os.environ.get("ULYSSES_OVERLAP_PROJECTIONS") == "1"
