"""The engine's table of DeepSpeed replacements and the version check (megatron/training/engine/replacements.py):
every target exists in the installed DeepSpeed, every replacement the engine makes is declared, an
unsupported DeepSpeed stops pretrain_gpt.py before any process group with one line, and the escape
flag runs it with the replacements off."""
import ast
import os
import sys

import pytest

from megatron.training.engine import replacements
from tests.conftest import REPO_ROOT
from tests.training.e2e_utils import run_command, scaled_timeout, tiny_gpt_flags

ENGINE_DIR = os.path.join(REPO_ROOT, "megatron", "training", "engine")
GUARDS = ("replace", "replaced_for_block", "is_enabled")


def test_every_target_exists_in_the_installed_deepspeed():
    assert replacements.missing_targets() == []


class _Assigning:
    def __init__(self):
        self.plain = 1
        self.annotated: int = 2
        self.indexed = {}
        self.indexed[0] = 3

    def compares(self):
        return self.compared == 1


def _outside():
    self = _Assigning()
    self.assigned_outside_the_class = 4
    return self


def test_an_instance_attribute_counts_when_the_class_assigns_it():
    """``self.<name> =`` or ``self.<name>: T =`` inside the class's lines, not a comparison, an
    item assignment or an assignment in the code after the class."""
    assert replacements._assigns(_Assigning, "plain") and replacements._assigns(_Assigning, "annotated")
    assert replacements._assigns(_Assigning, "indexed")
    assert not replacements._assigns(_Assigning, "plai") and not replacements._assigns(_Assigning, "compared")
    assert not replacements._assigns(_Assigning, "assigned_outside_the_class")


def test_a_missing_target_is_found_and_refused_unless_allowed(monkeypatch):
    monkeypatch.setitem(replacements.REPLACEMENTS, "test.fake",
                        replacements.Replacement("runtime.engine.DeepSpeedEngine.no_such_method", "test.fake", "x"))
    assert replacements.missing_targets() == ["runtime.engine.DeepSpeedEngine.no_such_method"]
    try:
        with pytest.raises(replacements.UnsupportedDeepSpeedError, match="lacks what the engine replaces"):
            replacements.check_deepspeed(False)
        warnings = replacements.check_deepspeed(True)
        assert len(warnings) == 1 and warnings[0].endswith("replacements: test.fake")
        assert not replacements.is_enabled("test.fake") and replacements.is_enabled("bf16_steps.clip_in_adamw")
    finally:
        monkeypatch.delitem(replacements.REPLACEMENTS, "test.fake")
        replacements.check_deepspeed(False)


def guarded_names() -> list[tuple[str, str]]:
    """(file, name) of every replacement name the engine package passes to replace / is_enabled."""
    found = []
    for filename in sorted(os.listdir(ENGINE_DIR)):
        if not filename.endswith(".py"):
            continue
        with open(os.path.join(ENGINE_DIR, filename)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in GUARDS \
                    and node.args and isinstance(node.args[0], ast.Constant):
                found.append((filename, node.args[0].value))
    return found


def test_every_replacement_made_is_declared_and_every_declared_one_is_made():
    made = guarded_names()
    undeclared = [f"{filename}: {name}" for filename, name in made if name not in replacements.REPLACEMENTS]
    assert not undeclared, undeclared
    assert {name for _, name in made} == set(replacements.REPLACEMENTS)


def test_versions_are_read_as_major_minor():
    assert replacements.version_tuple("0.19.8") == (0, 19)
    assert replacements.version_tuple("0.20.0+cu124") == (0, 20)
    assert replacements.version_tuple("1.0rc1") == (1, 0)


def test_an_unsupported_version_is_refused_unless_allowed():
    try:
        with pytest.raises(replacements.UnsupportedDeepSpeedError, match=r"DeepSpeed 0\.16\.4 is installed.*"
                           r"deepspeed>=0\.19,<0\.20.*--allow-untested-deepspeed"):
            replacements.check_deepspeed(False, version="0.16.4")
        warnings = replacements.check_deepspeed(True, version="0.16.4")
        assert len(warnings) == 1 and "bf16_steps.accumulate_in_one_kernel" in warnings[0]
        assert not replacements.is_enabled("bf16_steps.clip_in_adamw")
        owner = type("Owner", (), {"step": "DeepSpeed's"})()
        assert replacements.replace("bf16_steps.clip_in_adamw", owner, "step", "ours") is False
        assert owner.step == "DeepSpeed's"
    finally:
        assert replacements.check_deepspeed(False) == []
    assert replacements.is_enabled("bf16_steps.clip_in_adamw")


def test_an_undeclared_name_is_an_error():
    with pytest.raises(KeyError, match="not declared"):
        replacements.is_enabled("bf16_steps.something_new")


FAKED_VERSION = """
import runpy, sys
import deepspeed
deepspeed.__version__ = "0.16.4"
script = sys.argv[1]
sys.argv = [script.rpartition("/")[2]] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def run_under_deepspeed_0_16(flags: list[str], script: str = "pretrain_gpt.py"):
    return run_command([sys.executable, "-c", FAKED_VERSION, script, *flags], timeout=scaled_timeout(300))


def test_pretrain_refuses_an_unsupported_deepspeed_before_any_process_group(e2e_data, tmp_path):
    """pretrain_gpt.py under a DeepSpeed that reports 0.16.4: exit 2, one error line naming both
    versions and the escape flag, no process group, nothing written."""
    flags = tiny_gpt_flags(e2e_data) + ["--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
                                        "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    result = run_under_deepspeed_0_16(flags)
    errors = [line for line in result.output.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert result.returncode == 2, result.output[-3000:]
    assert len(errors) == 1 and "DeepSpeed 0.16.4 is installed" in errors[0] and ">=0.19,<0.20" in errors[0] \
        and "--allow-untested-deepspeed" in errors[0], errors
    assert "initializing torch distributed" not in result.output and "Traceback" not in result.output
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_the_escape_flag_trains_with_deepspeeds_own_code(e2e_data):
    """--allow-untested-deepspeed: one warning naming the replacements left off, then the run trains."""
    flags = tiny_gpt_flags(e2e_data) + ["--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
                                        "--log-interval", "1", "--eval-iters", "0", "--bf16",
                                        "--allow-untested-deepspeed"]
    result = run_under_deepspeed_0_16(flags)
    result.assert_ok()
    warnings = [line for line in result.output.splitlines() if line.startswith("WARNING: DeepSpeed 0.16.4")]
    assert len(warnings) == 1 and "bf16_steps.accumulate_in_one_kernel" in warnings[0]
    assert len(result.log_lines()) == 2


def test_generation_refuses_an_unsupported_deepspeed_at_parse(tmp_path):
    """The inference tools check DeepSpeed where they parse their flags: one line, exit 2, before
    any checkpoint is read (--load names a directory that does not exist)."""
    result = run_under_deepspeed_0_16(["--load", str(tmp_path / "missing"), "--num-samples", "1",
                                       "--genfile", str(tmp_path / "out.json")], "tools/generate_samples_gpt.py")
    errors = [line for line in result.output.splitlines() if line.startswith("generate_samples_gpt.py: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.output[-3000:]
    assert "DeepSpeed 0.16.4 is installed" in errors[0] and not (tmp_path / "out.json").exists()
