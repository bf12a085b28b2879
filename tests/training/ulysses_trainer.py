"""pretrain_gpt.py counting DeepSpeed-Ulysses' attention calls by path: ULYSSES_OVERLAP_PROJECTIONS=0 or 1 sets
ulysses.OVERLAP_PROJECTIONS first; at exit each rank prints "Ulysses attention calls: projections N, pipelined M"."""
import atexit
import os
import runpy
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _counted(function, calls: dict, path: str):
    def counted(*args, **kwargs):
        calls[path] += 1
        return function(*args, **kwargs)
    return counted


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from megatron.core.models.gpt import attention, ulysses

    setting = os.environ.get("ULYSSES_OVERLAP_PROJECTIONS")
    if setting:
        ulysses.OVERLAP_PROJECTIONS = setting == "1"
    calls = {"projections": 0, "pipelined": 0}
    attention.overlapped_attention = _counted(attention.overlapped_attention, calls, "projections")
    ulysses.pipelined_attention = _counted(ulysses.pipelined_attention, calls, "pipelined")
    atexit.register(lambda: print(f"Ulysses attention calls: projections {calls['projections']}, "
                                  f"pipelined {calls['pipelined']}", flush=True))
    runpy.run_path(os.path.join(REPO_ROOT, "pretrain_gpt.py"), run_name="__main__")
