"""A smaller GPU on a larger one: each trainer rank caps PyTorch's caching allocator at ``GPU_MEMORY_MIB``.

``tests/gpu/run_trainer.sh`` puts this folder first on ``PYTHONPATH`` for its ``@h100`` runs, so that the
runs the acceptance criteria set on an 80 GB H100 can be made on an H200. Memory outside the allocator
(the CUDA context, NCCL's buffers) is not capped; the script's default cap leaves room for it.
"""
import os

if os.environ.get("GPU_MEMORY_MIB") and "LOCAL_RANK" in os.environ:
    import torch

    _device = int(os.environ["LOCAL_RANK"])
    _total = torch.cuda.get_device_properties(_device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, int(os.environ["GPU_MEMORY_MIB"]) * 2**20 / _total), _device)
