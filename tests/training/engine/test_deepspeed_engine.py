"""The adapters of megatron/training/engine/deepspeed_engine.py offer the whole TrainingEngine protocol the
trainer uses (interface.py), with the same parameters; the trainer itself never names DeepSpeed."""
import ast
import inspect
import os

import pytest

from megatron.training.engine.deepspeed_engine import PipelineEngine, PlainEngine
from megatron.training.engine.interface import TrainingEngine
from tests.conftest import REPO_ROOT

PROTOCOL_METHODS = [name for name, member in vars(TrainingEngine).items()
                    if not name.startswith("_") and (callable(member) or isinstance(member, property))]
PROTOCOL_ATTRIBUTES = list(TrainingEngine.__annotations__)


@pytest.mark.parametrize("adapter", [PipelineEngine, PlainEngine], ids=lambda cls: cls.__name__)
def test_each_adapter_offers_the_protocol(adapter):
    assert {"train_step", "eval_step", "save", "load", "grad_norm", "loss_scale"} <= set(PROTOCOL_METHODS)
    for name in PROTOCOL_METHODS:
        member = getattr(adapter, name)
        expected = getattr(TrainingEngine, name)
        if isinstance(expected, property):
            assert isinstance(member, property), name
        else:
            assert list(inspect.signature(member).parameters) == list(inspect.signature(expected).parameters), name
    source = inspect.getsource(adapter) + inspect.getsource(adapter.__mro__[1])
    for name in PROTOCOL_ATTRIBUTES:
        assert f"{name} =" in source, f"{adapter.__name__} never sets {name}"


def test_the_training_loop_has_no_engine_kind_branch():
    """training.py drives the engine through the protocol: no test of the engine's kind, no DeepSpeed name
    (``config.deepspeed`` is the configuration's section of DeepSpeed settings)."""
    path = os.path.join(REPO_ROOT, "megatron", "training", "training.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not {"PipelineEngine", "PlainEngine", "PipelineModule", "deepspeed"} & names
    assert not {"PipelineEngine", "PlainEngine", "PipelineModule"} & attributes
    assert not {"pipeline", "train_batch", "eval_batch", "set_batch_fn"} & attributes



def test_deepspeed_runs_without_importing_muon():
    """With the stand-in, DeepSpeed's ZeRO optimizer check answers as before for the optimizers a run
    builds (and one ZeRO does not list), and Muon's real module, whose import pulls in torch's
    inductor, stays unloaded."""
    import subprocess
    import sys

    script = """
import sys, torch
from megatron.training.engine.deepspeed_engine import MUON_MODULE, without_muon
from deepspeed.runtime.zero import utils
utils.dist.get_rank = lambda: 1  # the check logs on rank 0, which needs a process group
without_muon()
parameters = [torch.nn.Parameter(torch.zeros(2))]
answers = [utils.is_zero_supported_optimizer(optimizer) for optimizer in
           (torch.optim.AdamW(parameters), torch.optim.Adam(parameters), torch.optim.SGD(parameters))]
print(answers, 'torch._inductor.compile_fx' in sys.modules, getattr(sys.modules[MUON_MODULE], '__file__', None))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300,
                            cwd=REPO_ROOT)
    assert result.stdout.strip().splitlines()[-1] == "[True, True, False] False None"


class _Stage3Bf16Engine:
    """What apply_replacements asks of a bf16 engine at ZeRO-3 whose optimizer is not offloaded."""

    module = None
    optimizer = object()

    def fp16_enabled(self):
        return False

    def bfloat16_enabled(self):
        return True

    def zero_optimization(self):
        return True

    def zero_optimization_stage(self):
        return 3


def test_bf16_at_zero_3_gets_none_of_the_bf16_step_replacements(monkeypatch, capsys):
    from types import SimpleNamespace

    from megatron.training.engine import bf16_steps, deepspeed_engine

    applied = []
    for name in ("accumulate_in_one_kernel", "norm_in_few_kernels", "adamw_writes_bf16_weights", "clip_in_adamw",
                 "skip_single_rank_reduction", "fuse_weight_gradient_accumulation"):
        monkeypatch.setattr(bf16_steps, name, lambda engine, name=name: applied.append(name))
    config = SimpleNamespace(precision=SimpleNamespace(gradient_accumulation_fusion=True),
                             logging=SimpleNamespace(log_num_zeros_in_grad=False),
                             parallel=SimpleNamespace(sync_tp_duplicated_parameters=False))
    deepspeed_engine.apply_replacements(_Stage3Bf16Engine(), config, SimpleNamespace(tp_size=1))
    assert applied == []
    assert deepspeed_engine.ZERO3_STEPS_LINE in capsys.readouterr().out
