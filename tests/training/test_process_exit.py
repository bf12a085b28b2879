"""exit_without_finalization: a finished run ends as the interpreter would (threads joined, atexit handlers
run, buffered output flushed, the status kept) but without the interpreter's finalization, where torch's
C++ teardown could abort a complete run."""
import subprocess
import sys
import textwrap

from tests.training.e2e_utils import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from megatron.training.signals import exit_without_finalization

    class Finalized:
        def __del__(self):
            print("finalized", flush=True)

    KEPT = Finalized()  # a module global: only finalization deletes it
    atexit.register(lambda: print("atexit handler"))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
    sys.stdout.write("buffered, no newline")
    sys.stderr.write("on stderr; ")
    exit_without_finalization(3)
""")


def test_handlers_run_output_flushed_status_kept_finalization_skipped():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith("buffered, no newlinethread done\natexit handler\n")
    assert "finalized" not in result.stdout
    assert result.stderr.startswith("on stderr; ")


def test_the_same_script_finalizes_without_it():
    """The control: the plain interpreter exit does delete the global (so the test above can see a skip)."""
    script = SCRIPT.replace("exit_without_finalization(3)", "sys.exit(3)")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 3
    assert "finalized" in result.stdout
