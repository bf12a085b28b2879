#!/bin/bash
# Every GPU check and benchmark in one go, on the GPU machine, from the repository root:
#   bash tests/gpu/run_all.sh            (logs under $OUT, default /tmp/gpu_checks)
# GPU tests, fused-kernel table, the optimizer step, attention and GEMMs of the 1.3B, 1.3B forward+backward, text generation
# (the 1.3B GPT and the Llama-style 1.2B), the decode layer chain, then the trainer runs of run_trainer.sh
# (with 2 or more GPUs also the DP/TP/PP layout comparison), the trainer against transformers +
# torch.compile (bench_vs_peer.sh: the 1.3B, the 350M and the Llama-style 1.2B) and, with 2 or more GPUs, the bandwidth of TP's collectives
# (bench_collectives.py), the fused collectives of --tp-comm-overlap (bench_async_tp.py) and the scaling table (bench_scaling.sh).
# Takes about 25 minutes on one H100.
# The GPU machine has no network and no DeepSpeed: carry DeepSpeed's wheel (and any other missing
# package) in .whl/ at the repository root, and it is installed from there.
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/device.txt"
python3 -m pytest -q -rfs -m gpu --continue-on-collection-errors tests 2>&1 | tee "$OUT/gpu_tests.log" || status=1
python3 tools/benchmarks/bench_fused_kernels.py 2>&1 | tee "$OUT/fused_kernels_bench.log" || status=1
python3 tools/benchmarks/bench_adamw_step.py 2>&1 | tee "$OUT/adamw_step_bench.log" || status=1
python3 tools/benchmarks/bench_attention.py 2>&1 | tee "$OUT/attention_bench.log" || status=1
python3 tools/benchmarks/bench_elementwise_ops.py 2>&1 | tee "$OUT/elementwise_ops_bench.log" || status=1
python3 tools/benchmarks/bench_gemms.py 2>&1 | tee "$OUT/gemms_bench.log" || status=1
python3 tools/benchmarks/bench_gpt_model.py 2>&1 | tee "$OUT/gpt_1p3b_bench.log" || status=1
python3 tools/benchmarks/bench_text_generation.py 2>&1 | tee "$OUT/text_generation_bench.log" || status=1
python3 tools/benchmarks/bench_text_generation.py --model llama1p2b --skip-growing-cache 2>&1 \
    | tee "$OUT/text_generation_llama_bench.log" || status=1
python3 tools/benchmarks/bench_decode_layers.py 2>&1 | tee "$OUT/decode_layers_bench.log" || status=1
runs="example overflow 350m_bf16 350m_fp16 1p3b_bf16 1p3b_fp16"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    runs="$runs layout_single layout_dp2 layout_tp2 layout_pp2 layout_compare"
fi
RUNS=$runs OUT=$OUT/trainer bash tests/gpu/run_trainer.sh > "$OUT/trainer.log" 2>&1 || status=1
OUT=$OUT/vs_peer bash tools/benchmarks/bench_vs_peer.sh > "$OUT/vs_peer.log" 2>&1 || status=1
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # 1 GPU, DP=2, TP=2 (with and without sequence parallelism), PP=2
    # TP's collectives at its message sizes on two GPUs, with NCCL's own protocol choice and with Simple
    for proto in default Simple; do
        env $([ $proto = Simple ] && echo NCCL_PROTO=Simple) CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 \
            tools/benchmarks/bench_collectives.py 2>&1 | grep -E "^\||^backend" | tee "$OUT/collectives_$proto.md" || status=1
    done
    # sequence parallelism's collectives pipelined with their GEMMs (--tp-comm-overlap) against NCCL, then the GEMM
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 tools/benchmarks/bench_async_tp.py 2>&1 \
        | grep -E "^\||^TP=" | tee "$OUT/async_tp.md" || status=1
    OUT=$OUT/scaling bash tools/benchmarks/bench_scaling.sh > "$OUT/scaling.log" 2>&1 || status=1
    # one profiled iteration of 1 GPU, TP=2, TP=2 with sequence parallelism, and with --tp-comm-overlap
    RUNS="profile_1gpu profile_tp2 profile_tp2_sp profile_tp2_overlap" OUT=$OUT/profiles bash tests/gpu/run_trainer.sh \
        > "$OUT/profiles.log" 2>&1 || status=1
    python3 tools/benchmarks/trace_summary.py "$OUT"/profiles/profile_*/*.pt.trace.json \
        > "$OUT/profiles/trace_summary.md" || status=1
    # GPU time by launching operator: one GPU against a TP=2 rank (doubled)
    python3 tools/benchmarks/trace_summary.py --by-operator --multiply 1 2 -- \
        "$OUT"/profiles/profile_1gpu/*.pt.trace.json "$OUT"/profiles/profile_tp2_overlap/*.pt.trace.json \
        > "$OUT/profiles/by_operator.md" || status=1
    # where each profile's GPU idles: waiting for its host, or for an event or a peer
    python3 tools/benchmarks/trace_summary.py --idle "$OUT"/profiles/profile_*/*.pt.trace.json \
        > "$OUT/profiles/idle.md" || status=1
fi
if [ -f runs/bnb_gpu/data/python-docs_text_document.idx ]; then  # 8-bit against 32-bit AdamW (run_bnb_adam.sh)
    OUT=$OUT/bnb bash tests/gpu/run_bnb_adam.sh > "$OUT/bnb.log" 2>&1 || status=1
fi
cat "$OUT/trainer/summary.txt" "$OUT/trainer/layouts.txt" "$OUT/vs_peer/vs_peer.txt" "$OUT"/collectives_*.md "$OUT/async_tp.md" \
    "$OUT/scaling/scaling_losses.txt" "$OUT/scaling/scaling_table.md" "$OUT/profiles/trace_summary.md" 2>/dev/null
exit $status
