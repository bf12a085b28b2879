"""A smaller GPU on a larger one: each trainer rank caps PyTorch's caching allocator at ``GPU_MEMORY_MIB``.

``tests/gpu/run_trainer.sh`` puts this folder first on ``PYTHONPATH`` for its ``@h100`` runs, so that the
runs the acceptance criteria set on an 80 GB H100 can be made on an H200. Memory outside the allocator
(the CUDA context, NCCL's buffers) is not capped; the script's default cap leaves room for it.

With ``GPU_MEMORY_HISTORY=PREFIX`` set too, each rank records the allocator's history from its start and,
at its exit, writes ``PREFIX.rank<R>.md``: the blocks alive at its peak by where they were allocated
(``tools/benchmarks/memory_peak.py``).

With ``HOST_MEMORY_REPORT=PREFIX`` set too, each rank appends to ``PREFIX.rank<R>.txt`` every 5 s its host memory by
kind (anonymous, file-backed and shared pages resident, from /proc/self/status) and the pinned memory
PyTorch's host allocator holds (``torch.cuda.host_memory_stats``), with the time of day: which of them grows
when a run's host memory does (``tools/benchmarks/host_memory.py`` gives the whole run's).
"""
import atexit
import importlib.util
import os
import sys
import threading
import time

# The trainer's ranks only: the loader's fork server, started with their environment, must not open a CUDA context.
_is_trainer_rank = "LOCAL_RANK" in os.environ and os.path.basename(getattr(sys, "argv", [""])[0]) == "pretrain_gpt.py"

if os.environ.get("GPU_MEMORY_MIB") and _is_trainer_rank:
    import torch

    _device = int(os.environ["LOCAL_RANK"])
    _total = torch.cuda.get_device_properties(_device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, int(os.environ["GPU_MEMORY_MIB"]) * 2**20 / _total), _device)

    if os.environ.get("GPU_MEMORY_HISTORY"):
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)

        def _write_peak_report(prefix=os.environ["GPU_MEMORY_HISTORY"], rank=os.environ.get("RANK", "0")):
            spec = importlib.util.spec_from_file_location("memory_peak", os.path.join(
                os.path.dirname(__file__), "..", "..", "..", "tools", "benchmarks", "memory_peak.py"))
            memory_peak = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(memory_peak)
            with open(f"{prefix}.rank{rank}.md", "w") as handle:
                handle.write(memory_peak.report(torch.cuda.memory._snapshot()) + "\n")

        atexit.register(_write_peak_report)

    if os.environ.get("HOST_MEMORY_REPORT"):
        def _host_memory_line() -> str:
            with open("/proc/self/status") as status:
                kinds = {line.split(":")[0]: int(line.split()[1]) // 1024 for line in status
                         if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem"))}
            pinned = getattr(torch.cuda, "host_memory_stats", dict)()
            held = {key: value // 2**20 for key, value in pinned.items() if "bytes" in key and "current" in key}
            return f"{time.strftime('%H:%M:%S')} MB: {kinds} pinned: {held}"

        def _report_host_memory(path=f"{os.environ['HOST_MEMORY_REPORT']}.rank{os.environ.get('RANK', '0')}.txt"):
            while True:
                with open(path, "a") as report:
                    report.write(_host_memory_line() + "\n")
                time.sleep(5)

        threading.Thread(target=_report_host_memory, daemon=True).start()
