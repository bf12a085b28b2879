"""Layer files: found per layer and TP rank, incomplete sets refused by name, a layer read back whole
from partitions written by split_partitions."""
import pytest
import torch

from megatron.core.checkpoint.layer_files import (LayerFilesError, find_layer_files, read_full_layer,
                                                  write_layer)
from megatron.core.checkpoint.partitions import split_partitions
from megatron.core.checkpoint.sharding import ModelSharding
from tests.core.models.gpt.gpt_test_utils import tiny_config

FULL_LAYER = {
    "input_layernorm.weight": torch.randn(8),
    "self_attention.query_key_value.weight": torch.randn(24, 8),
    "self_attention.dense.weight": torch.randn(8, 8),
    "self_attention.dense.bias": torch.randn(8),
    "mlp.dense_h_to_4h.weight": torch.randn(32, 8),
    "mlp.dense_4h_to_h.weight": torch.randn(8, 16),
}
PLAIN = ModelSharding(tiny_config())
GLU = ModelSharding(tiny_config(glu_activation="swiglu", bias_gelu_fusion=False))


def sharding(glu):
    return GLU if glu else PLAIN


def write_partitions(directory, layer, full, tp_size, glu=False):
    """An independent writer: the partitions as the trainer's ranks would save them."""
    parts = {name: split_partitions(value, sharding(glu).layer_split(layer, name), tp_size)
             for name, value in full.items()}
    for rank in range(tp_size):
        torch.save({name: parts[name][rank] for name in full},
                   directory / f"layer_{layer:02d}-model_{rank:02d}-model_states.pt")


@pytest.mark.parametrize("tp_size,glu", [(1, False), (2, False), (4, False), (2, True)])
def test_a_layer_is_read_back_whole(tmp_path, tp_size, glu):
    write_partitions(tmp_path, 3, FULL_LAYER, tp_size, glu)
    write_partitions(tmp_path, 4, FULL_LAYER, tp_size, glu)
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"not a layer file")
    files = find_layer_files(str(tmp_path))
    assert files.layers == [3, 4] and files.tp_size == tp_size
    read = read_full_layer(files, 3, sharding(glu))
    assert list(read) == list(FULL_LAYER)
    for name, value in FULL_LAYER.items():
        torch.testing.assert_close(read[name], value, rtol=0, atol=0)


def test_a_missing_rank_is_named(tmp_path):
    write_partitions(tmp_path, 3, FULL_LAYER, 2)
    write_partitions(tmp_path, 4, FULL_LAYER, 2)
    (tmp_path / "layer_04-model_01-model_states.pt").unlink()
    with pytest.raises(LayerFilesError, match="layer_04-model_01-model_states.pt missing"):
        find_layer_files(str(tmp_path))


def test_no_layer_file_or_no_directory_is_refused(tmp_path):
    with pytest.raises(LayerFilesError, match="no layer_XX-model_TT-model_states.pt file"):
        find_layer_files(str(tmp_path))
    with pytest.raises(LayerFilesError, match="no such checkpoint directory"):
        find_layer_files(str(tmp_path / "global_step9"))


def test_ranks_with_different_parameters_are_refused(tmp_path):
    write_partitions(tmp_path, 3, FULL_LAYER, 2)
    torch.save({"input_layernorm.weight": torch.zeros(8)}, tmp_path / "layer_03-model_01-model_states.pt")
    with pytest.raises(LayerFilesError, match="layer_03-model_01-model_states.pt: parameters"):
        read_full_layer(find_layer_files(str(tmp_path)), 3, PLAIN)


@pytest.mark.parametrize("source_tp,target_tp", [(2, 4), (4, 1), (1, 2)])
def test_a_layer_rewritten_at_another_tp_size_reads_back_the_same(tmp_path, source_tp, target_tp):
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    write_partitions(source, 3, FULL_LAYER, source_tp, glu=True)
    full = read_full_layer(find_layer_files(str(source)), 3, GLU)
    paths = write_layer(str(target), 3, full, target_tp, GLU)
    assert [p.rsplit("/", 1)[1] for p in paths] == [f"layer_03-model_{r:02d}-model_states.pt" for r in range(target_tp)]
    assert sorted(p.name for p in target.iterdir()) == sorted(p.rsplit("/", 1)[1] for p in paths)  # no temporary
    rank_0 = torch.load(paths[0], weights_only=True)
    assert rank_0["self_attention.query_key_value.weight"].shape == (24 // target_tp, 8)
    read = read_full_layer(find_layer_files(str(target)), 3, GLU)
    for name, value in FULL_LAYER.items():
        torch.testing.assert_close(read[name], value, rtol=0, atol=0)


def test_a_key_that_is_no_parameter_of_the_model_is_named(tmp_path):
    write_partitions(tmp_path, 3, FULL_LAYER, 1)
    torch.save({**FULL_LAYER, "mlp.extra.weight": torch.zeros(2)}, tmp_path / "layer_03-model_00-model_states.pt")
    with pytest.raises(LayerFilesError, match=r"layer_03-model_00-model_states.pt: 3.mlp.extra.weight is not a "
                                              r"parameter of this 2-layer GPT model"):
        read_full_layer(find_layer_files(str(tmp_path)), 3, PLAIN)
