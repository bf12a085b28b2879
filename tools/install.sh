#!/bin/bash
# Installs the framework and what it needs into the active Python environment (a virtualenv or not).
# torch is installed only if missing, as torch==$TORCH_VERSION (default 2.13.0) from the configured
# index: install the build that fits the machine first, since the default index may serve a multi-GB
# CUDA build. DeepSpeed is built from its source archive without its CUDA ops (they are JIT-built
# where a GPU exists); on a machine without CUDA its two CPU ops are compiled here, once.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! $py -c "import torch" >/dev/null 2>&1; then
    $py -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
DS_BUILD_OPS=0 $py -m pip install -q -e ".[test]"
$py -c "import torch, deepspeed, megatron; from megatron.core.data.helpers import load_helpers; load_helpers(); print(f'installed: torch {torch.__version__}, deepspeed {deepspeed.__version__}')"
# Without CUDA, DeepSpeed compiles two small ops on first use: its shared-memory collectives (every
# run) and its CPU Adam (ZeRO optimizer offload). Build them now, once, into torch's extensions cache.
$py -c "
import torch
if not torch.cuda.is_available():
    from megatron.training.initialize import select_accelerator
    select_accelerator()
    from megatron.training.engine.distributed import build_deepspeed_cpu_ops
    build_deepspeed_cpu_ops()"
