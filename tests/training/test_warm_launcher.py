"""The warm launcher (tests/training/warm_launcher.py): a script forked from it ends as a new interpreter
would, with the environment, directory, arguments and output it was given."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.training.e2e_utils import PRETRAIN_SCRIPT, _warm_trainer, kill_sessions, subprocess_env
from tests.training.warm_launcher import WarmProcess

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "marker", os.environ.get("WARM_MARKER"))
    print("main", __name__, "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
    action = sys.argv[1]
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "message":
        sys.exit("stopped: a message")
    if action == "raise":
        raise ValueError("boom")
    if action == "interrupt":
        raise KeyboardInterrupt
    if action == "sleep":
        time.sleep(60)
""")


def _start(tmp_path, *arguments, env=None):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    output = tmp_path / "output.txt"
    process = WarmProcess([str(script), *arguments], subprocess_env({"WARM_MARKER": "yes", **(env or {})}),
                          str(tmp_path), str(output))
    return process, output


@pytest.mark.parametrize("arguments, status, expected", [
    (("exit", "0"), 0, []),
    (("exit", "3"), 3, []),
    (("message",), 1, ["stopped: a message"]),
    (("raise",), 1, ["Traceback (most recent call last):", "ValueError: boom"]),
    (("interrupt",), -signal.SIGINT, ["KeyboardInterrupt"]),
])
def test_a_script_ends_as_an_interpreter_would(tmp_path, arguments, status, expected):
    process, output = _start(tmp_path, *arguments)
    assert process.wait(timeout=60) == status
    text = output.read_text()
    assert f"argv {list(arguments)} cwd {tmp_path} marker yes" in text
    assert "main __main__ path0 True" in text
    assert text.index("thread joined") < text.index("atexit ran")  # threads joined first, as at shutdown
    assert all(line in text for line in expected), text


def test_kill_sessions_kills_a_warm_process(tmp_path):
    process, _ = _start(tmp_path, "sleep")
    assert process.poll() is None
    kill_sessions([process])
    assert process.wait(timeout=60) == -signal.SIGKILL
    sleeping, _ = _start(tmp_path, "sleep")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            sleeping.wait(timeout=0.1)
    finally:
        kill_sessions([sleeping])
    assert sleeping.wait(timeout=60) == -signal.SIGKILL


def test_two_processes_append_to_one_output(tmp_path):
    first, output = _start(tmp_path, "exit", "0")
    second, _ = _start(tmp_path, "exit", "0")
    assert (first.wait(timeout=60), second.wait(timeout=60)) == (0, 0)
    assert output.read_text().count("atexit ran") == 2


def test_only_the_trainer_on_a_cpu_machine_starts_warm(monkeypatch):
    import torch

    trainer = [sys.executable, PRETRAIN_SCRIPT, "--help"]
    assert _warm_trainer(trainer) == (not torch.cuda.is_available())
    assert not _warm_trainer([sys.executable, os.path.join(os.path.dirname(PRETRAIN_SCRIPT), "tools", "x.py")])
    monkeypatch.setenv("MEGATRON_TEST_WARM", "0")
    assert not _warm_trainer(trainer)
