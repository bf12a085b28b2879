"""tasks/eval_harness/evaluate.py on the session's TP=2 x PP=2-trained checkpoint: the offline local
task group (local_tasks.py) gives the figures the harness's own Hugging Face model (HFLM) gives on
the transformers model that tools/convert_checkpoint/deepspeed_to_transformers.py exports from the
same checkpoint; an unknown task is refused by name.
"""
import json

import pytest

from tests.tasks.eval_harness.local_tasks import GROUP, figures, write_local_tasks
from tests.tasks.eval_harness.test_megatron_lm import evaluate
from tests.tasks.trained_checkpoint import SEQ_LENGTH, checkpoint_path, trained  # noqa: F401
from tools.convert_checkpoint import deepspeed_to_transformers

lm_eval = pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_figures_equal_the_exported_transformers_model(trained, tmp_path, capsys):  # noqa: F811
    import transformers
    from lm_eval.models.huggingface import HFLM

    from tasks.eval_harness.evaluate import main

    data, save = trained
    exported = str(tmp_path / "hf")
    assert deepspeed_to_transformers.main(["--input_folder", checkpoint_path(save), "--output_folder", exported]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    include_path = write_local_tasks(str(tmp_path / "tasks"))
    expected = figures(evaluate(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, max_length=SEQ_LENGTH,
                                     batch_size=1, device="cpu"), include_path))

    results_path = tmp_path / "out" / "results.json"
    common = ["--load", save, "--micro-batch-size", "2", "--vocab-file", data.vocab_file, "--merge-file",
              data.merge_file, "--include_path", include_path, "--bootstrap_iters", "0"]
    assert main(common + ["--task_list", GROUP, "--results_path", str(results_path), "--adaptive_seq_len",
                          "--micro_bs_multiplier", "2", "--seq-length", str(SEQ_LENGTH)]) == 0
    found = figures(json.loads(results_path.read_text()))
    assert found == pytest.approx(expected, rel=1e-5)
    assert "tiny_rolling" in capsys.readouterr().out
    print({name: round(value, 6) for name, value in found.items()})

    assert main(common + ["--task_list", "tiny_choice,no_such_task"]) == 2
    assert "--task_list: no_such_task: no such task" in capsys.readouterr().err
