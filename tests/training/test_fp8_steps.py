"""The trainer's FP8 side: the log line's fields, the notices of a checkpoint whose FP8 state does not
carry over, and evaluation leaving delayed scaling's recorded amaxes alone."""
import pytest
import torch

from megatron.core.checkpoint.client_state import plain_value
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core.tensor_parallel.fp8 import Fp8Config
from megatron.training.fp8_steps import fp8_checkpoint_notice, keep_delayed_amaxes
from megatron.training.log_reader import read_log
from megatron.training.metrics import TrainingLogFields, training_log_line
from tests.core.models.gpt.gpt_test_utils import random_tokens, tiny_config

DELAYED = Fp8Config(recipe="delayed", emulate=True)


def saved_args(fp8):
    return {"model": plain_value(tiny_config(fp8=fp8))}


def test_log_line_appends_the_quantization_and_the_counts_readably():
    fields = TrainingLogFields(iteration=3, train_iters=10, consumed_samples=12, consumed_tokens=768,
                               elapsed_time_per_iteration=0.5, learning_rate=1e-3, global_batch_size=4,
                               skipped_iterations=0, nan_iterations=0, samples_per_second=8.0, tflops=1.0,
                               losses={"lm loss": 7.0}, quantization="FP8 hybrid delayed", amax_overflows=5,
                               amax_underflows=2)
    line = training_log_line(fields)
    assert line.endswith(" TFLOPs: 1.00 | quantization: FP8 hybrid delayed | amax overflows: 5 | amax underflows: 2 |")
    record = read_log(line).iterations[0]
    assert record.fields["quantization"] == "FP8 hybrid delayed" and record.integer("amax underflows") == 2


@pytest.mark.parametrize("saved, configured, words", [
    (DELAYED, None, "dropped: this run has no FP8"),
    (DELAYED, Fp8Config(recipe="rowwise", emulate=True), "dropped: this run uses the rowwise recipe"),
    (None, DELAYED, "has no FP8 delayed-scaling state: the amax histories and scales start fresh"),
    (Fp8Config(recipe="tensorwise"), DELAYED, "has no FP8 delayed-scaling state"),
    (DELAYED, Fp8Config(recipe="delayed", amax_history_len=8), "holds 1 steps, this run's 8"),
])
def test_notice_when_the_fp8_state_does_not_carry_over(saved, configured, words):
    notice = fp8_checkpoint_notice(saved_args(saved), tiny_config(fp8=configured))
    assert notice.startswith("notice: ") and words in notice


@pytest.mark.parametrize("saved, configured", [(None, None), (DELAYED, DELAYED),
                                               (Fp8Config(recipe="tensorwise"), None)])
def test_no_notice_when_it_does(saved, configured):
    assert fp8_checkpoint_notice(saved_args(saved), tiny_config(fp8=configured)) is None


def test_notice_of_a_universal_checkpoint_under_delayed_scaling():
    notice = fp8_checkpoint_notice(saved_args(DELAYED), tiny_config(fp8=DELAYED), universal=True)
    assert notice.startswith("notice: a universal checkpoint holds no FP8 delayed-scaling state")
    assert fp8_checkpoint_notice(saved_args(None), tiny_config(), universal=True) is None


def test_evaluation_leaves_the_recorded_amaxes_as_they_were():
    model = GPTModel(tiny_config(fp8=DELAYED), single_rank_groups())
    histories = [buffer for name, buffer in model.named_buffers() if name.endswith("amax_history")]
    before = [history.clone() for history in histories]
    with torch.no_grad(), keep_delayed_amaxes(model):
        model(random_tokens(2, 16, 64))
        assert any(not torch.equal(a, b) for a, b in zip(histories, before))  # recorded during the block
    assert all(torch.equal(a, b) for a, b in zip(histories, before))
