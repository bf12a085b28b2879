"""Activation recompute changes memory, never the numbers: pretrain_gpt.py runs with dropout on (0.1 in
attention and on the hidden states) give the losses and gradient norms of the run without recompute
under selective recompute (the default modules, and all four), full recompute by uniform chunks
(--checkpoint-activations --checkpoint-num-layers 2) and by block (--recompute-method block
--recompute-num-layers 2), and, on the pipeline engine at PP = 2, under block recompute of the first
layer of each stage and under selective recompute in the first layer of each stage (block).

Set-up: test_layout_equivalence's flags (fp32, CPU initialization, padded vocabulary 1152, clipping
at 1.0 that every step triggers) with 4 layers, 3 iterations of 4 micro-batches. The recomputation
replays the RNG streams, so the dropout masks and every sum are the same: the tolerance 1e-6
relative only covers a different order of gradient accumulation (seen: bit-identical).
"""
import pytest

from tests.training.parallel_3d_runs import train
from tests.training.test_layout_equivalence import common_flags

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TRAIN_ITERS, NUM_LAYERS, RTOL = 3, 4, 1e-6
STEPS = list(range(1, TRAIN_ITERS + 1))
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# name -> (processes, recompute flags)
RUNS = {
    "none": (1, []),
    "selective": (1, ["--recompute-activations"]),
    "selective-all": (1, ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm",
                          "mlp_act", "mlp"]),
    "full-uniform": (1, ["--checkpoint-activations", "--checkpoint-num-layers", "2"]),
    "full-block": (1, ["--recompute-granularity", "full", "--recompute-method", "block",
                       "--recompute-num-layers", "2"]),
    "pp2-none": (2, PP2),
    "pp2-block": (2, PP2 + ["--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "1"]),
    "pp2-selective": (2, PP2 + ["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                                "layernorm", "mlp_act", "--recompute-method", "block", "--recompute-num-layers", "1"]),
}


@pytest.fixture(scope="module")
def runs(e2e_data, tmp_path_factory) -> dict:
    flags = common_flags(e2e_data, num_layers=NUM_LAYERS, train_iters=TRAIN_ITERS) + DROPOUT
    return {name: train(flags + extra, processes, str(tmp_path_factory.mktemp(f"tb_recompute_{name}")), STEPS)
            for name, (processes, extra) in RUNS.items()}


@pytest.mark.parametrize("name, baseline", [("selective", "none"), ("selective-all", "none"),
                                            ("full-uniform", "none"), ("full-block", "none"),
                                            ("pp2-block", "pp2-none"), ("pp2-selective", "pp2-none")])
def test_recompute_gives_the_losses_of_no_recompute(runs, name, baseline):
    assert runs[name]["loss"] == pytest.approx(runs[baseline]["loss"], rel=RTOL)
    assert runs[name]["grad_norm"] == pytest.approx(runs[baseline]["grad_norm"], rel=RTOL)


def test_dropout_is_on(runs):
    """Dropout draws other masks at PP = 2 (each stage seeds seed + 100 x stage): were it off, the
    pipeline runs would give the single process's losses."""
    assert abs(runs["pp2-none"]["loss"][0] - runs["none"]["loss"][0]) > 1e-4
