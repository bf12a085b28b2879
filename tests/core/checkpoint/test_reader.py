"""reader.verify_files: every manifest file present at its size; CRC-32 of the optimizer partitions only
when the caller reads them."""
import pytest

from megatron.core.checkpoint.manifest import describe_file, write_manifest
from megatron.core.checkpoint.reader import CheckpointInputError, verify_files

WEIGHTS, OPTIMIZER = "layer_01-model_00-model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def flip_first_byte(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def checkpoint(tmp_path):
    for name in (WEIGHTS, OPTIMIZER):
        (tmp_path / name).write_bytes(b"0123456789")
    write_manifest(str(tmp_path), 1, {name: describe_file(str(tmp_path / name)) for name in (WEIGHTS, OPTIMIZER)})
    return tmp_path


def test_a_damaged_optimizer_partition_is_caught_only_when_it_will_be_read(checkpoint):
    flip_first_byte(checkpoint / OPTIMIZER)
    assert verify_files(str(checkpoint), read_optimizer=False) == 1
    with pytest.raises(CheckpointInputError, match=f"{OPTIMIZER}: CRC-32"):
        verify_files(str(checkpoint), read_optimizer=True)


def test_weights_are_always_verified_and_every_file_must_have_its_size(checkpoint):
    flip_first_byte(checkpoint / WEIGHTS)
    with pytest.raises(CheckpointInputError, match=f"{WEIGHTS}: CRC-32"):
        verify_files(str(checkpoint), read_optimizer=False)
    (checkpoint / OPTIMIZER).write_bytes(b"01234")
    with pytest.raises(CheckpointInputError, match=f"{OPTIMIZER} has 5 bytes"):
        verify_files(str(checkpoint), read_optimizer=False)
