"""The checkpoint tools choose DeepSpeed's accelerator before anything imports deepspeed.

Otherwise DeepSpeed guesses on a machine without CUDA and warns "Setting accelerator to CPU" once in
the tool and once in each of its worker processes (five times for ds_to_universal).
"""
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

TOOL_MODULES = ("tools.convert_checkpoint.ds_to_universal", "tools.convert_checkpoint.deepspeed_to_deepspeed",
                "tools.convert_checkpoint.deepspeed_to_megatron", "tools.convert_checkpoint.deepspeed_to_transformers",
                "tools.convert_checkpoint.transformers_to_megatron", "tools.merge_mp_partitions")


def test_importing_a_tool_chooses_the_accelerator_before_deepspeed_guesses():
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    for module in TOOL_MODULES:
        program = (f"import importlib, os; importlib.import_module({module!r}); "
                   "from deepspeed.accelerator import get_accelerator; "
                   "print(os.environ.get('DS_ACCELERATOR'), get_accelerator().device_name())")
        done = subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-2:] == ["cpu", "cpu"], (module, done.stdout)
        assert "Setting accelerator" not in done.stdout + done.stderr, module
