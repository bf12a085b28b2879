"""Benchmarks only: DeepSpeed-Ulysses' exchange set in each trainer rank by the environment, so that
``tests/gpu/run_trainer.sh`` can compare settings without a flag (``megatron.core.models.gpt.ulysses``):
``ULYSSES_CHUNKS=N`` pipelines the exchange in N chunks whatever the heads per attention call
(``ulysses_s2_32k_c<N>``), ``ULYSSES_EXCHANGE=peer`` sends it through peer memory (``.._peer``) and
``nccl`` through NCCL (``.._nccl``; the default, "auto", takes peer memory within one host),
``ULYSSES_OVERLAP_PROJECTIONS=1`` hides it behind the projections instead (``.._proj``; once any setting is
given, a variant without ``_proj`` runs the pipelined exchange, which a run with none of them, the default
at TP = 1, does not). Fewer chunks give each attention call more heads; more chunks hide more of the
all-to-alls."""
import os
import sys

SETTINGS = ("ULYSSES_CHUNKS", "ULYSSES_EXCHANGE", "ULYSSES_OVERLAP_PROJECTIONS")


def _checked(name: str, allowed) -> str:
    value = os.environ.get(name, "")
    if value and not allowed(value):
        print(f"tests/gpu/ulysses_chunks: {name}={value!r} is not a setting it knows", file=sys.stderr)
        os._exit(2)  # an exception here would end the interpreter's start-up with a fatal error
    return value


if "LOCAL_RANK" in os.environ and any(os.environ.get(name) for name in SETTINGS):
    from megatron.core.models.gpt import ulysses

    chunks = _checked("ULYSSES_CHUNKS", lambda value: value.isdigit() and int(value) > 0)
    exchange = _checked("ULYSSES_EXCHANGE", lambda value: value in ("nccl", "peer", "auto"))
    projections = _checked("ULYSSES_OVERLAP_PROJECTIONS", lambda value: value in ("0", "1"))
    if chunks:
        ulysses.MAX_CHUNKS, ulysses.MIN_HEADS_PER_CALL = int(chunks), 1
    ulysses.EXCHANGE = exchange or ulysses.EXCHANGE
    ulysses.OVERLAP_PROJECTIONS = projections == "1"
