"""The split of each parameter is read from the model's own layers, under every naming a checkpoint
uses; a parameter added to a layer is known without any table."""
import pytest
import torch
from torch import nn

from megatron.core.checkpoint.names import ParameterNameError
from megatron.core.checkpoint.partitions import TensorSplit
from megatron.core.checkpoint.sharding import ModelSharding, model_sharding, module_splits
from megatron.core.models.gpt import mlp
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tests.core.models.gpt.gpt_test_utils import tiny_config

GLU = tiny_config(glu_activation="swiglu", bias_gelu_fusion=False, embed_layernorm=True)


def test_every_parameter_has_the_split_its_layer_marked():
    sharding = ModelSharding(GLU)
    model = GPTModel(GLU, single_rank_groups())
    assert set(sharding.splits) == {name for name, _ in model.named_parameters()}
    for name, parameter in model.named_parameters():
        split = sharding.split(name)
        if getattr(parameter, "tensor_model_parallel", False):
            assert (split.dim, split.stride) == (parameter.partition_dim, parameter.partition_stride), name
        else:
            assert split.replicated, name


def test_the_names_of_both_engines_layer_files_and_megatron_deepspeed_agree():
    sharding = ModelSharding(GLU)  # 2 layers: transformer layers 3 and 4, the final norm 6
    assert sharding.split("layers.1.mlp.dense_h_to_4h.weight") == TensorSplit(0, stride=2)
    assert sharding.split("4.mlp.dense_h_to_4h.bias") == TensorSplit(0, stride=2)
    assert sharding.layer_split(3, "self_attention.dense.weight") == TensorSplit(1)
    assert sharding.layer_split(3, "self_attention.dense.bias").replicated
    assert sharding.layer_split(1, "word_embeddings.weight") == TensorSplit(0, vocabulary=True)
    assert sharding.split("tied_modules.embed.word_embeddings.weight").vocabulary
    assert sharding.layer_split(6, "weight").replicated
    assert sharding.layer_split(1, "word_embeddings.norm.weight").replicated  # Megatron-DeepSpeed's embed_layernorm
    assert ModelSharding(tiny_config()).split("3.mlp.dense_h_to_4h.weight") == TensorSplit(0)
    assert model_sharding(GLU) is model_sharding(tiny_config(glu_activation="swiglu", bias_gelu_fusion=False,
                                                             embed_layernorm=True))


def test_a_name_outside_the_model_is_refused_by_name():
    sharding = ModelSharding(tiny_config())
    with pytest.raises(ParameterNameError, match="3.mlp.gate.weight is not a parameter of this 2-layer GPT model"):
        sharding.layer_split(3, "mlp.gate.weight")
    with pytest.raises(ParameterNameError, match="embedding.embed_layernorm.weight is not a parameter"):
        sharding.split("embedding.embed_layernorm.weight")  # the model has no embedding LayerNorm
    with pytest.raises(ParameterNameError):
        sharding.split("9.input_layernorm.weight")


def test_a_parameter_added_to_a_layer_is_split_as_its_layer_marks_it(monkeypatch):
    built = mlp.ParallelMLP.__init__

    def with_extra_projections(self, config, layer_number, groups, device=None):
        built(self, config, layer_number, groups, device=device)
        common = dict(tp_group=groups.tp, init_method=nn.init.zeros_, device=device,
                      use_cpu_initialization=config.use_cpu_initialization)
        self.extra_in = ColumnParallelLinear(config.hidden_size, 6 * config.hidden_size, stride=3, **common)
        self.extra_out = RowParallelLinear(config.hidden_size, config.hidden_size, **common)

    monkeypatch.setattr(mlp.ParallelMLP, "__init__", with_extra_projections)
    sharding = ModelSharding(tiny_config())
    assert sharding.layer_split(4, "mlp.extra_in.weight") == TensorSplit(0, stride=3)
    assert sharding.layer_split(4, "mlp.extra_in.bias") == TensorSplit(0, stride=3)
    assert sharding.layer_split(4, "mlp.extra_out.weight") == TensorSplit(1)
    assert sharding.layer_split(4, "mlp.extra_out.bias").replicated


def test_module_splits_mark_the_vocabulary_table():
    table = VocabParallelEmbedding(16, 4, tp_group=None, init_method=nn.init.zeros_, use_cpu_initialization=True)
    module = nn.ModuleDict({"table": table,
                            "norm": nn.LayerNorm(4)})
    assert module_splits(module) == {"table.weight": TensorSplit(0, vocabulary=True), "norm.weight": TensorSplit(None),
                                     "norm.bias": TensorSplit(None)}


def test_a_saved_configuration_builds_without_memory_for_its_weights():
    saved = {**vars(tiny_config(position_embedding_type="rotary")), "params_dtype": "torch.bfloat16",
             "max_position_embeddings": 16, "hidden_size": 8192, "num_attention_heads": 64,
             "padded_vocab_size": 250880, "num_layers": 4, "unknown_field": 1}
    sharding = ModelSharding.of_saved(saved)  # a [250880, 8192] table and 4 layers of 8192: not allocated
    assert sharding.split("embedding.word_embeddings.weight").vocabulary
    assert "embedding.position_embeddings.weight" not in sharding.splits
    assert sharding.split("layers.3.self_attention.query_key_value.weight") == TensorSplit(0)
    assert torch.get_default_device() == torch.device("cpu")
