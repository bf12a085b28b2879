"""origin.py: this trainer's checkpoints are told from another trainer's by their state, and a missing
manifest is refused for ours (unless allowed, then a warning), a notice for another's."""
import argparse

import pytest

from megatron.core.checkpoint.origin import (WRITER_KEY, UnverifiedCheckpointError, unverified_reading_line,
                                             written_by_this_trainer)

OURS = {"iteration": 2, "args": {"model": {"num_layers": 2}, "tensor_model_parallel_size": 1}}


@pytest.mark.parametrize("state, ours", [
    (OURS, True),
    ({**OURS, WRITER_KEY: "Megatron-DeepSpeed"}, False),  # translated from Megatron-DeepSpeed's
    ({"iteration": 2, "args": argparse.Namespace(num_layers=2)}, False),  # Megatron-DeepSpeed's own
    ({"iteration": 2, "args": {"num_layers": 2}}, False),
    ({"module": {}}, False),
])
def test_this_trainers_state_is_recognised(state, ours):
    assert written_by_this_trainer(state) is ours


def test_our_checkpoint_without_manifest_is_refused_naming_the_flag():
    with pytest.raises(UnverifiedCheckpointError) as error:
        unverified_reading_line("ckpt/global_step2", OURS, False, "--allow-missing-manifest", "restore it")
    message = str(error.value)
    assert message.startswith("ckpt/global_step2 has no manifest.json, though this trainer wrote it")
    assert message.endswith("restore it, or add --allow-missing-manifest to read them unverified")


def test_allowed_it_is_a_warning_and_another_trainers_a_notice():
    warning = unverified_reading_line("ckpt/global_step2", OURS, True, "--allow-missing-manifest", "restore it")
    assert warning.startswith("WARNING: ckpt/global_step2 has no manifest.json") and "UNVERIFIED" in warning
    foreign = {**OURS, WRITER_KEY: "Megatron-DeepSpeed"}
    for allowed in (False, True):
        notice = unverified_reading_line("ckpt/global_step2", foreign, allowed, "--allow-missing-manifest", "")
        assert notice == ("notice: ckpt/global_step2 was written by Megatron-DeepSpeed (no manifest.json): its files "
                          "are read without checksum verification")
