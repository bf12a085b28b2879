"""tools/benchmarks/compare_before_after.py on recorded GPU logs: the trainer's mean model TFLOP/s after
the warm-up iterations and our best text-generation rate per batch, with their ratio."""
import shutil

from tools.benchmarks import compare_before_after
from tests.conftest import REPO_ROOT

RESULTS = f"{REPO_ROOT}/benchmarks/results"
TRAINER_LOG = f"{RESULTS}/2026-11-27/h200_s2_trainer_peer_1p3b.log"
GENERATION_LOG = f"{RESULTS}/2026-11-25/h100_text_generation_bench.log"


def test_the_table_compares_each_figure(tmp_path):
    for label in ("before", "after"):
        (tmp_path / label).mkdir()
        shutil.copy(TRAINER_LOG, tmp_path / label / "peer_1p3b.log")
    shutil.copy(GENERATION_LOG, tmp_path / "after" / "text_generation.log")
    lines = compare_before_after.table(str(tmp_path / "before"), str(tmp_path / "after"))
    trainer = next(line for line in lines if line.startswith("| 1.3B GPT"))
    figure = compare_before_after.trainer_figure(str(tmp_path / "after"), "peer_1p3b")
    assert figure is not None and 100.0 < figure < 1000.0
    assert trainer == f"| 1.3B GPT, micro-batch 8 | model TFLOP/s | {figure:.1f} | {figure:.1f} | 1.000 |"
    assert "| 350M GPT, micro-batch 32 | model TFLOP/s | n/a | n/a | n/a |" in lines
    rates = compare_before_after.generation_figures(str(tmp_path / "after"))
    assert set(rates) == {1, 32} and rates[1] >= 394.0  # the best of our variants, never transformers'
    assert f"| text generation, batch 1 | tokens/s | n/a | {rates[1]:.1f} | n/a |" in lines
