"""tasks/eval_harness/evaluate.py on the session's TP=2 x PP=2-trained checkpoint, launched on 4 gloo
ranks (torchrun) under the saved layout: the offline local task group (local_tasks.py) gives the
figures of the adapter on the checkpoint's model run whole in this process (rel 1e-6), and those the
harness's own Hugging Face model (HFLM) gives on the transformers model that
tools/convert_checkpoint/deepspeed_to_transformers.py exports from the same checkpoint (rel 1e-5);
an unknown task is refused by name before any process group starts.
"""
import json
import os

import pytest

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.tokenizer import GPT2BPETokenizer
from tests.conftest import REPO_ROOT
from tests.tasks.eval_harness.local_tasks import GROUP, figures, write_local_tasks
from tests.tasks.eval_harness.test_megatron_lm import evaluate, pipeline_of
from tests.tasks.trained_checkpoint import SEQ_LENGTH, checkpoint_path
from tests.training.e2e_utils import run_ranks
from tools.convert_checkpoint import deepspeed_to_transformers

lm_eval = pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
EVALUATE = os.path.join(REPO_ROOT, "tasks", "eval_harness", "evaluate.py")


def test_tp2_pp2_launch_equals_one_process_and_the_exported_model(trained, tmp_path, capsys):
    import transformers
    from lm_eval.models.huggingface import HFLM

    from tasks.eval_harness.evaluate import main
    from tasks.eval_harness.megatron_lm import MegatronLM

    data, save = trained
    include_path = write_local_tasks(str(tmp_path / "tasks"))
    results_path = tmp_path / "out" / "results.json"
    common = ["--load", save, "--micro-batch-size", "2", "--vocab-file", data.vocab_file, "--merge-file",
              data.merge_file, "--include_path", include_path, "--bootstrap_iters", "0"]
    result = run_ranks([EVALUATE, *common, "--task_list", GROUP, "--results_path", str(results_path),
                        "--adaptive_seq_len", "--micro_bs_multiplier", "2", "--seq-length", str(SEQ_LENGTH)], 4,
                       timeout=600)
    result.assert_ok()
    assert result.output.count("|word_perplexity|") == 1  # one table, printed by global rank 0
    found = figures(json.loads(results_path.read_text()))

    tokenizer = GPT2BPETokenizer(data.vocab_file, data.merge_file)
    whole = pipeline_of(load_gpt_model(open_checkpoint(checkpoint_path(save))))
    one_process = figures(evaluate(MegatronLM(whole, tokenizer, SEQ_LENGTH, batch_size=4, adaptive_seq_len=True),
                                   include_path))
    assert found == pytest.approx(one_process, rel=1e-6)

    exported = str(tmp_path / "hf")
    assert deepspeed_to_transformers.main(["--input_folder", checkpoint_path(save), "--output_folder", exported]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    expected = figures(evaluate(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, max_length=SEQ_LENGTH,
                                     batch_size=1, device="cpu"), include_path))
    assert found == pytest.approx(expected, rel=1e-5)
    print({name: round(value, 6) for name, value in found.items()})

    with pytest.raises(SystemExit) as exit_status:
        main(common + ["--task_list", "tiny_choice,no_such_task"])
    assert exit_status.value.code == 2
    assert "--task_list: no_such_task: no such task" in capsys.readouterr().err
