"""GPTModelPipe under full recompute: uniform hands DeepSpeed the chunk interval; block checkpoints
the first --recompute-num-layers transformer layers of each stage, one by one, and no other layer;
under selective recompute, block keeps the recomputed modules to those layers."""
import dataclasses

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron.core.parallel_state import initialize_model_parallel
from megatron.training.engine.pipeline_module import GPTModelPipe, ParallelTransformerLayerPipe
from tests.core.models.gpt.gpt_test_utils import tiny_config
from tests.dist_utils import run_distributed


def _stage_layers(module):
    return [f for f in module.forward_funcs if isinstance(f, ParallelTransformerLayerPipe)]


def _worker(rank, world_size):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    groups = initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1)
    config = tiny_config(num_layers=6, checkpoint_activations=True, recompute_method="block", checkpoint_num_layers=2)
    block = GPTModelPipe(config, groups, topology, partition_method="type:transformer")
    layers = _stage_layers(block)
    assert len(layers) == 3 and block.activation_checkpoint_interval == 0
    assert [layer.block_recompute is not None for layer in layers] == [True, True, False]
    assert {layer.layer_number for layer in layers} == ({1, 2, 3} if rank == 0 else {4, 5, 6})

    uniform = GPTModelPipe(dataclasses.replace(config, recompute_method="uniform"), groups, topology,
                           partition_method="type:transformer")
    assert uniform.activation_checkpoint_interval == 2
    assert all(layer.block_recompute is None for layer in _stage_layers(uniform))
    plain = GPTModelPipe(dataclasses.replace(config, checkpoint_activations=False), groups, topology,
                         partition_method="type:transformer")
    assert plain.activation_checkpoint_interval == 0
    assert all(layer.block_recompute is None for layer in _stage_layers(plain))
    selective = GPTModelPipe(dataclasses.replace(config, checkpoint_activations=False, recompute_modules=("mlp_act",)),
                             groups, topology, partition_method="type:transformer")
    assert [layer.mlp.recompute_modules for layer in _stage_layers(selective)] == [("mlp_act",)] * 2 + [()]


@pytest.mark.distributed
def test_block_recompute_marks_the_first_layers_of_each_stage():
    run_distributed(_worker, 2)
