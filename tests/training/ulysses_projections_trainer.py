"""pretrain_gpt.py with DeepSpeed-Ulysses' exchanges beside the projections (ulysses.OVERLAP_PROJECTIONS); at
exit each rank prints how many attention calls took that path."""
import atexit
import os
import runpy
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from megatron.core.models.gpt import attention, ulysses

    ulysses.OVERLAP_PROJECTIONS = True
    overlapped_attention, calls = attention.overlapped_attention, []

    def counted(*args, **kwargs):
        calls.append(1)
        return overlapped_attention(*args, **kwargs)

    attention.overlapped_attention = counted
    atexit.register(lambda: print(f"projections-overlapped attention calls: {len(calls)}", flush=True))
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
