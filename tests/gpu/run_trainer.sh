#!/bin/bash
# The trainer on GPUs through the deepspeed launcher (the GPU acceptance runs of issues 4 and 5):
#   1. Megatron-DeepSpeed's single-node example, unmodified (fp16 on a GPU)
#   2. 350M and 1.3B GPTs at seq 2048, bf16 and fp16, with model TFLOP/s and MFU in the log line
#   3. a forced fp16 overflow: initial loss scale 2^24, hysteresis 1, so the first iterations
#      overflow; the log's skipped count must equal the number of halvings of the loss scale
#   4. layouts on 2 GPUs (RUNS="layout_single layout_dp2 layout_tp2 layout_pp2 layout_compare"): fp32,
#      dropout 0, CPU initialization, the same padded vocabulary and global batch; DP=2 (ZeRO-1),
#      TP=2 and PP=2 must give the single GPU's losses
#   5. the 6.7B GPT (32 layers, hidden 4096, 32 heads, seq 2048, bf16, CPU initialization,
#      global batch 16, 60 iterations): on 4 GPUs RUNS="6p7b_tp2pp2 6p7b_tp2dp2 6p7b_compare", the
#      losses and grad norms of iterations 1-5 must agree in bf16; RUNS="6p7b_tp2pp2_save
#      6p7b_tp2pp2_resume 6p7b_resume_compare" saves at iteration 30 (SAVE_AT), stops, resumes and must
#      continue 6p7b_tp2pp2 (counters and LR equal); RUNS="6p7b_tp2pp2_saving 6p7b_tp2pp2_rollback
#      6p7b_rollback_compare" saves at 30 and 60, points latest back at 30 and resumes (CKPT_NGPUS=8
#      runs these at TP=2 x PP=2 x DP=2); on 8 GPUs RUNS="6p7b_tp2pp2dp2 6p7b_tp4pp2 6p7b_tp2pp4
#      6p7b_compare_8"; for speed on 4 GPUs RUNS="6p7b_tp2dp2_mbs4 6p7b_tp2dp2_mbs4_overlap" (TP=2 x DP=2 with
#      sequence parallelism, without and with --tp-comm-overlap; micro-batch 4, GPU initialization)
#   6. the best single-GPU figure at the same width (RUNS="w4096_mbs2 w4096_mbs4"): 16 layers, hidden
#      4096, bf16, the scaling-efficiency reference for 5; the same model at TP=2 on 2 GPUs (RUNS="w4096_tp2 w4096_tp2_overlap")
#   7. against the peer (RUNS="peer_1p3b peer_1p3b_mbs16 peer_1p3b_mbs32 peer_350m peer_350m_mbs32", log interval 1):
#      the 1.3B at micro-batch 8, 16 and 32 and the 350M at 16 and 32, bf16, ZeRO-1; tools/benchmarks/bench_vs_peer.sh
#      runs them and the peer
#   7b. the Llama-style 1.2B against the peer (RUNS="llama1p2b_mbs1 llama1p2b_mbs2 llama1p2b_mbs4"): 16 layers,
#      hidden 2048, 32 heads over 8 key/value groups, SwiGLU ffn 8192, RoPE base 500000, RMSNorm, untied
#      output layer, no biases, seq 4096, vocabulary padded to 128256 (the data's GPT-2 BPE ids all fit),
#      bf16, ZeRO-1, global batch 16, ITERS_LLAMA iterations (default 10), log interval 1
#   8. scaling (RUNS="scale_1gpu scale_dp2 scale_tp2 scale_tp2_sp scale_pp2 scale_pp2_flops", and with 4 GPUs
#      "scale_tp2dp2 scale_tp2dp2_sp scale_pp4 scale_pp4_flops"): the 1.3B GPT, bf16, ZeRO-1, micro-batch 8, global
#      batch 64 (8 micro-batches per pipeline), CPU initialization (the same weights in every layout);
#      tools/benchmarks/bench_scaling.sh runs them and prints the table
#   8b. profiles (RUNS="profile_1gpu profile_tp2 profile_tp2_sp"): the scaling runs for 6 iterations, the
#      last under torch.profiler on rank 0 (--profile --use-pytorch-profiler): a trace and an
#      operator table in $OUT/<run>/; also profile_zero1_dp2 and profile_zero3_dp2 (DP = 2 at ZeRO-1 and 3),
#      profile_bf16_1p3b and profile_fp8_1p3b (one GPU, micro-batch 16, bf16 and FP8 delayed)
#   9. a checkpoint to convert (RUNS="1p3b_checkpoint"): the 1.3B GPT, bf16, ZeRO-1, saved after 3
#      iterations in $WORK/checkpoint_1p3b; tools/benchmarks/bench_checkpoint_conversion.sh converts it
#   10. a universal checkpoint in fp16 (RUNS="universal_fp16"; fp16 does not run on CPU): a 125M GPT saved
#      at ZeRO-1 after 10 of 20 iterations, converted by ds_to_universal.py, resumed at ZeRO-2 (the plain
#      engine) with --universal-checkpoint, must continue the uninterrupted run (compare_logs.py resume)
#   11. long runs (RUNS="rel_bf16 rel_fp16 det_cost offload"): a 350M GPT in bf16 and in fp16 under
#      --deterministic saves at 10 of 20 iterations, resumes from 10 and must give the same losses,
#      counters and rates (tolerance 0); the 1.3B GPT in bf16 at micro batch 4 (the materialized
#      attention of --deterministic holds s^2 scores per head) with and without --deterministic (the
#      cost of determinism); the 1.3B GPT in bf16 at ZeRO-2 with the optimizer offloaded to the CPU
#   12. selective recompute (RUNS="1p3b_bf16 1p3b_mbs16_selective recompute_compare"): the 1.3B GPT at
#      micro-batch 16 with --recompute-activations (the default modules, layernorm and mlp_act) against
#      1p3b_bf16 (micro-batch 8, no recompute), global batch 32 both; recompute_compare prints each run's
#      mean model TFLOP/s (iterations after the first log line), max allocated MB and the ratio to the
#      first run. Variants: 1p3b_mbs16_mlp_act (--recompute-modules mlp_act), 1p3b_mbs16_core_attn
#      (core_attn layernorm mlp_act), 1p3b_mbs16_mlp_act_block<N> (mlp_act in the first N layers only:
#      --recompute-method block --recompute-num-layers N), 1p3b_mbs16 (no recompute: expected out of memory)
#   13. DeepSpeed-Ulysses (RUNS="ulysses_1gpu_16k ulysses_1gpu_24k ulysses_1gpu_32k ulysses_s2_32k ulysses_compare"):
#      the 1.3B GPT, bf16, ZeRO-1, micro-batch 1, global batch 8, log interval 2, on one GPU at sequences
#      K x 1024 (ulysses_1gpu_<K>k, e.g. 16k, 32k, 56k: the longest that fits is the reference) and on two
#      GPUs at 32768 with --ds-sequence-parallel-size 2; ulysses_compare prints each run's mean per-GPU
#      model TFLOP/s, max allocated MB and the ratio to the first run. With 4 GPUs: ulysses_s4_64k (65536, S = 4);
#      variants ulysses_s<S>_<K>k[_c<N>][_peer|_nccl][_proj][_mbs<B>] run S GPUs at K x 1024 (micro-batch B, default
#      1) with the exchange in exactly N chunks, through peer memory (copy engines) or NCCL (default: peer memory
#      within one host), hidden behind the projections' GEMMs with one attention call per layer
#      (ulysses_projections) instead of chunks of heads (tests/gpu/ulysses_chunks; a variant without _proj is
#      pipelined, ulysses_s<S>_<K>k alone takes the default: beside the projections at TP = 1); profile_<variant>
#      (and profile_ulysses_1gpu_<K>k) profiles its fourth iteration on rank 0 into $OUT/profile_<variant>/
#   14. ZeRO-3 (RUNS="zero1_1p3b_dp2 zero3_1p3b_dp2 zero3_compare" on 2 GPUs): the 1.3B GPT, bf16, micro-batch 8,
#      global batch 32, 12 iterations, log interval 2, at ZeRO-1 and at ZeRO-3 on two GPUs; zero3_compare prints
#      each run's mean per-GPU model TFLOP/s, max allocated MB and the ratio to ZeRO-1 (with zero1_1p3b_dp2_mbsN and
#      zero3_1p3b_dp2_mbsN: micro-batch N, global batch 4N, also in the table). On one GPU, ZeRO-3 with
#      the parameters and the optimizer offloaded to the CPU (RUNS="zero3_offload_2p7b zero3_offload_6p7b
#      zero3_offload_13b zero3_offload_compare"): the 2.7B, 6.7B and 13B GPTs of the GPT-3 table, bf16,
#      micro-batch 1, global batch 8, 6 iterations; zero3_offload_compare prints the same table for them (a run
#      that did not fit shows "none"); zero3_optoffload_6p7b offloads the optimizer only
#   15. FP8 (issue 35; hybrid format). Speed on one GPU: fp8_1p3b_<recipe>_mbs<N> is the 1.3B GPT at seq 2048, global
#      batch 32, ITERS_FP8 iterations (default 12), log interval 2, in bf16 (recipe "bf16") or FP8 (delayed,
#      tensorwise, rowwise) at micro-batch N, e.g. RUNS="fp8_1p3b_bf16_mbs8 fp8_1p3b_bf16_mbs16 fp8_1p3b_delayed_mbs8
#      fp8_1p3b_delayed_mbs16 fp8_1p3b_compare"; fp8_1p3b_compare prints the mean model TFLOP/s (the same model
#      FLOPs for both), max allocated MB and the ratio to the first run of every fp8_1p3b_* log in $OUT. On two
#      GPUs: fp8_6p7b_tp2_<recipe>_mbs<N> (the 6.7B at TP = 2 with sequence parallelism and selective recompute,
#      global batch 16; a name ending in _gbs<G> sets the global batch, e.g. fp8_6p7b_tp2_delayed-overlap_mbs8_gbs64) and
#      fp8_6p7b_compare. Loss parity on one GPU: RUNS="fp8_parity_bf16 fp8_parity_delayed
#      fp8_parity_tensorwise fp8_parity_rowwise fp8_parity_compare": the 350M GPT, PARITY_ITERS iterations
#      (default 2000), seq 1024, micro-batch = global batch = PARITY_GBS (default 2: 2000 iterations are six passes
#      over the corpus, short of memorizing it, where a loss near zero makes every ratio noise), lr 3e-4 (warmup
#      100, cosine to 3e-5), validation every 200 iterations, the same data order and seed; fp8_parity_compare checks each FP8
#      run against bf16 (tests/gpu/fp8_parity.py: final validation loss within 1 %, no loss over +10 %) and draws
#      the curves with tools/plot_logs.py into $OUT/fp8_parity/. RUNS="fp8_parity_side_by_side fp8_parity_compare"
#      runs the four at once over the GPUs of GPU_IDS (default all). Any run: GPU_IDS=1 (or 0,1) picks the GPUs,
#      MASTER_PORT its port.
#   16. an 80 GB H100 on a larger GPU: a run named NAME@h100 runs NAME with PyTorch's caching allocator capped at
#      H100_ALLOCATOR_MIB (default 80000: the H100's 81,106 MiB less about 1.1 GiB for the CUDA context and NCCL,
#      tests/gpu/memory_cap/sitecustomize.py), e.g. RUNS="1p3b_bf16@h100 1p3b_mbs16_selective@h100 1p3b_mbs16@h100".
#      The ZeRO-3 offload runs also write the largest host memory of their processes into <run>.log (every
#      second's reading into <run>.host_readings). With GPU_MEMORY_HISTORY=PREFIX an @h100 run's ranks record the
#      allocator's history and write PREFIX.rank<R>.md, the blocks alive at the peak by where they were allocated
#      (tools/benchmarks/memory_peak.py); with HOST_MEMORY_REPORT=PREFIX they write their host memory by kind and
#      PyTorch's pinned memory every 5 s into PREFIX.rank<R>.txt.
#   17. several runs at once on one machine: LANES="0,1=zero1_1p3b_dp2 zero3_1p3b_dp2;2=1p3b_bf16@h100;3=..." runs
#      each lane's runs in order on its GPUs (its own port and data cache), the lanes side by side, then RUNS
#      (the comparisons).
# Run from the repository root on the GPU machine with .whl carried; logs go to $OUT.
#   RUNS="350m_bf16 overflow" bash tests/gpu/run_trainer.sh    (a subset)
#   EXTRA_ARGS="--no-gradient-accumulation-fusion" RUNS=scale_1gpu OUT=... bash tests/gpu/run_trainer.sh
#                                                              (flags added to every run, for A/B comparisons)
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_trainer}
WORK=${WORK:-/tmp/gpu_trainer_work}
RUNS=${RUNS:-"example 350m_bf16 350m_fp16 1p3b_bf16 1p3b_fp16 overflow"}
ITERS=${ITERS:-20}
mkdir -p "$OUT" "$WORK"
if [ -z "${LANE:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then  # a lane has its parent's install
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0

prepare_data() {
    [ -f "$WORK/data/python-docs_text_document.idx" ] && return
    $py tools/train_tokenizer.py --input examples/data/python-docs.jsonl.gz --vocab-size 32000 \
        --output-dir "$WORK/tokenizer" || return 1
    $py tools/preprocess_data.py --input examples/data/python-docs.jsonl.gz --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$WORK/tokenizer/vocab.json" --merge-file "$WORK/tokenizer/merges.txt" \
        --append-eod --workers 8 --output-prefix "$WORK/data/python-docs"
}

ds_config() {  # precision initial_scale_power hysteresis -> path of a ds_config
    local path=$WORK/ds_config_$1_$2_$3.json
    if [ "$1" = fp32 ]; then
        precision='"fp16": {"enabled": false}'
    elif [ "$1" = fp16 ]; then
        precision="\"fp16\": {\"enabled\": true, \"loss_scale\": 0, \"loss_scale_window\": 500, \"hysteresis\": $3, \"min_loss_scale\": 1, \"initial_scale_power\": $2}"
    else
        precision='"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"}'
    fi
    local zero="\"stage\": ${ZERO_STAGE:-1}"
    [ -n "${OFFLOAD:-}" ] && zero="$zero, \"offload_optimizer\": {\"device\": \"cpu\"}"
    [ -n "${OFFLOAD_PARAM:-}" ] && zero="$zero, \"offload_param\": {\"device\": \"cpu\"}"
    path=${path%.json}_zero${ZERO_STAGE:-1}${OFFLOAD:+_offload}${OFFLOAD_PARAM:+_offload_param}.json
    echo "{\"train_micro_batch_size_per_gpu\": \"auto\", \"train_batch_size\": \"auto\", \"gradient_clipping\": 1.0,
  \"zero_optimization\": {$zero}, $precision, \"steps_per_print\": 100000}" > "$path"
    echo "$path"
}

gpt_run() {  # name layers hidden heads precision mbs gbs [extra flags...]
    local name=$1 layers=$2 hidden=$3 heads=$4 precision=$5 mbs=$6 gbs=$7
    shift 7
    local config
    config=$(ds_config "$precision" "${SCALE_POWER:-12}" "${HYSTERESIS:-2}")
    echo "== $name" | tee "$OUT/$name.log"
    local precision_flag=--$precision
    [ "$precision" = fp32 ] && precision_flag=
    local gpus=(--num_gpus "${NGPUS:-1}")
    [ -n "${GPU_IDS:-}" ] && gpus=(--include "localhost:$GPU_IDS")  # GPU_IDS=1 or 0,1: those GPUs only
    deepspeed "${gpus[@]}" --master_port "${MASTER_PORT:-29511}" pretrain_gpt.py \
        --num-layers "$layers" --hidden-size "$hidden" --num-attention-heads "$heads" \
        --seq-length "${SEQ:-2048}" --max-position-embeddings 2048 --pad-vocab-size-to 50304 \
        --micro-batch-size "$mbs" --global-batch-size "$gbs" --train-iters "$ITERS" \
        --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters $(( ITERS > 2 ? 2 : ITERS - 1 )) --lr-decay-style cosine --clip-grad 1.0 \
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 \
        --hidden-dropout 0 --attention-dropout 0 $precision_flag --seed 1234 \
        --vocab-file "$WORK/tokenizer/vocab.json" --merge-file "$WORK/tokenizer/merges.txt" \
        --data-path "$WORK/data/python-docs_text_document" --split 98,1,1 --data-cache-path "${DATA_CACHE:-$WORK/cache${LANE:-}}" \
        --log-interval "${LOG_INTERVAL:-5}" --eval-interval 1000 --eval-iters 0 \
        --deepspeed --deepspeed_config "$config" --zero-stage "${ZERO_STAGE:-1}" --distributed-backend nccl "$@" \
        ${EXTRA_ARGS:-} \
        2>&1 | tee -a "$OUT/$name.log" || status=1
}

layout_run() {  # name ngpus [parallel flags...]: a 100M-class GPT at seq 1024, fp32, 8 iterations
    local name=$1 ngpus=$2
    shift 2
    NGPUS=$ngpus SEQ=1024 ITERS=8 LOG_INTERVAL=1 gpt_run "$name" 8 1024 16 fp32 4 16 --use-cpu-initialization "$@"
}

scale_run() {  # name ngpus [parallel flags...]: the 1.3B GPT of the scaling table, log interval 1
    # (micro-batch MBS_SCALE, default 8)
    local name=$1 ngpus=$2
    shift 2
    NGPUS=$ngpus ITERS=${ITERS_SCALE:-10} LOG_INTERVAL=1 gpt_run "$name" 24 2048 16 bf16 "${MBS_SCALE:-8}" 64 \
        --use-cpu-initialization "$@"
}

profile_run() {  # name ngpus [parallel flags...]: scale_run with iteration 6 profiled on rank 0 into $OUT/name
    local name=$1 ngpus=$2
    shift 2
    ITERS_SCALE=6 scale_run "$name" "$ngpus" --tensorboard-dir "$OUT/$name" --profile --use-pytorch-profiler \
        --profile-step-start 5 --profile-step-end 6 --profile-ranks 0 "$@"
}

logs_of() {  # run... -> their log paths
    local run
    for run in "$@"; do echo "$OUT/$run.log"; done
}

compare_layouts() {  # tolerance iterations run... : losses and grad norms of iterations 1..N against the first run
    local tolerance=$1 iterations=$2
    shift 2
    $py tests/gpu/compare_logs.py layouts --tolerance "$tolerance" --first "$iterations" $(logs_of "$@")
}

llama_run() {  # name mbs: the Llama-style 1.2B of 7b (the later --max-position-embeddings and
    # --pad-vocab-size-to replace gpt_run's)
    local name=$1 mbs=$2
    SEQ=4096 LOG_INTERVAL=1 ITERS=${ITERS_LLAMA:-10} gpt_run "$name" 16 2048 32 bf16 "$mbs" 16 \
        --max-position-embeddings 4096 --pad-vocab-size-to 128256 --normalization RMSNorm --swiglu \
        --ffn-hidden-size 8192 --position-embedding-type rope --rotary-base 500000 --group-query-attention \
        --num-query-groups 8 --untie-embeddings-and-output-weights --disable-bias-linear
}

big_run() {  # name ngpus [flags...]: the 6.7B GPT (bf16, CPU initialization, global batch 16)
    local name=$1 ngpus=$2
    shift 2
    NGPUS=$ngpus ITERS=${ITERS_6P7B:-60} LOG_INTERVAL=1 gpt_run "$name" 32 4096 32 bf16 2 16 \
        --use-cpu-initialization --lr-warmup-iters 10 "$@"
}

big_fast_run() {  # name [flags...]: the 6.7B GPT at TP=2 x DP=2 for speed: micro-batch 4, global batch 32,
    # initialized on the GPUs (minutes faster than on the CPU), 12 iterations
    local name=$1
    shift
    NGPUS=4 ITERS=12 LOG_INTERVAL=1 gpt_run "$name" 32 4096 32 bf16 4 32 --tensor-model-parallel-size 2 "$@"
}

universal_runs() {  # precision: a 125M GPT at ZeRO-1 saved at 10 of 20 iterations, converted to a universal
    # checkpoint, resumed at ZeRO-2 (the plain engine) with --universal-checkpoint; compared with the full run
    local precision=$1 checkpoint=$WORK/checkpoint_universal_$1
    rm -rf "$checkpoint" "$checkpoint.universal"
    ITERS=20 LOG_INTERVAL=1 gpt_run "universal_${precision}_full" 12 768 12 "$precision" 4 16
    ITERS=20 LOG_INTERVAL=1 gpt_run "universal_${precision}_saved" 12 768 12 "$precision" 4 16 \
        --save "$checkpoint" --save-interval 10 --exit-interval 10
    $py tools/convert_checkpoint/ds_to_universal.py --input_folder "$checkpoint/global_step10" \
        --output_folder "$checkpoint.universal/global_step10_universal" 2>&1 | tail -1 | tee -a "$OUT/universal_$precision.txt"
    ZERO_STAGE=2 ITERS=20 LOG_INTERVAL=1 gpt_run "universal_${precision}_resumed" 12 768 12 "$precision" 4 16 \
        --load "$checkpoint.universal" --universal-checkpoint
    $py tests/gpu/compare_logs.py resume --tolerance 2e-2 \
        $(logs_of "universal_${precision}_full" "universal_${precision}_saved" "universal_${precision}_resumed") \
        | tee -a "$OUT/universal_$precision.txt" || status=1
}

reliability_runs() {  # precision: save at 10 of 20 deterministic iterations, resume from 10, compare (tolerance 0)
    local precision=$1 checkpoint=$WORK/checkpoint_rel_$1
    rm -rf "$checkpoint" "$checkpoint.resumed"
    ITERS=20 LOG_INTERVAL=1 gpt_run "rel_${precision}_full" 24 1024 16 "$precision" 4 32 --deterministic \
        --save "$checkpoint" --save-interval 10
    echo global_step10 > "$checkpoint/latest"
    ITERS=20 LOG_INTERVAL=1 gpt_run "rel_${precision}_resumed" 24 1024 16 "$precision" 4 32 --deterministic \
        --load "$checkpoint" --save "$checkpoint.resumed" --save-interval 100
    $py tests/gpu/compare_logs.py resume --tolerance 0 $(logs_of "rel_${precision}_full" "rel_${precision}_full" \
        "rel_${precision}_resumed") | tee "$OUT/resume_rel_${precision}.txt" || status=1
}

recompute_table() {  # run... : mean model TFLOP/s after the first log line, max allocated MB, ratio to the first run
    # (the iterations' memory line comes once, at the first log line: log interval 2 or more puts a whole step
    # with the optimizer states in its peak, which interval 1 does not; on the GPU a line after set-up comes first)
    local run first=
    for run in "$@"; do
        local log=$OUT/$run.log tflops peak
        tflops=$(grep -so "model TFLOP/s: [0-9.]*" "$log" | tail -n +2 | awk '{s += $3; n++} END {if (n) printf "%.2f", s / n}')
        peak=$(grep -s "iterations) memory (MB)" "$log" | grep -o "max allocated: [0-9.]*" | head -n 1 \
               | awk '{printf "%.0f", $3}')
        [ -z "$first" ] && first=$tflops
        echo "$run | model TFLOP/s: ${tflops:-none} | max allocated MB: ${peak:-none} | vs $1: $(awk -v a="$tflops" -v b="$first" 'BEGIN {if (a && b) printf "%.1f%%", 100 * a / b; else print "n/a"}')"
    done
}

ulysses_run() {  # name ngpus seq [flags...]: the 1.3B GPT at sequence seq, micro-batch $ULYSSES_MBS (1), global batch 8
    local name=$1 ngpus=$2 seq=$3
    shift 3
    NGPUS=$ngpus SEQ=$seq ITERS=${ITERS_ULYSSES:-10} LOG_INTERVAL=2 gpt_run "$name" 24 2048 16 bf16 "${ULYSSES_MBS:-1}" 8 \
        --max-position-embeddings "$seq" "$@"
}

ulysses_variant() {  # name ulysses_s<S>_<K>k[_c<N>][_peer][_proj][_mbs<B>] [flags...]: S GPUs at K x 1024 positions,
    # the exchange in exactly N chunks, through peer memory, behind the projections (tests/gpu/ulysses_chunks sets
    # them), micro-batch B
    local name=$1 spec=$2 chunks="" exchange="" projections="" micro_batch=1
    shift 2
    [[ $spec =~ _c([0-9]+) ]] && chunks=${BASH_REMATCH[1]}
    [[ $spec =~ _mbs([0-9]+) ]] && micro_batch=${BASH_REMATCH[1]}
    [[ $spec == *_peer* ]] && exchange=peer
    [[ $spec == *_nccl* ]] && exchange=nccl
    [[ $spec == *_proj* ]] && projections=1
    ULYSSES_CHUNKS=$chunks ULYSSES_EXCHANGE=$exchange ULYSSES_OVERLAP_PROJECTIONS=$projections ULYSSES_MBS=$micro_batch \
        PYTHONPATH=$PWD/tests/gpu/ulysses_chunks:$PYTHONPATH \
        ulysses_run "$name" "${spec:9:1}" $(( ${spec:11:2} * 1024 )) --ds-sequence-parallel-size "${spec:9:1}" "$@"
}

zero3_offload_run() {  # name layers hidden heads [flags...]: one GPU, ZeRO-3, parameters and optimizer on the CPU
    local name=$1 layers=$2 hidden=$3 heads=$4 sampler
    shift 4
    host_memory_peak "$name" &
    sampler=$!
    ZERO_STAGE=3 OFFLOAD=1 OFFLOAD_PARAM=${OFFLOAD_PARAM-1} ITERS=${ITERS_OFFLOAD:-6} LOG_INTERVAL=2 \
        DATA_CACHE=$WORK/cache_$name gpt_run "$name" "$layers" "$hidden" "$heads" bf16 1 8 "$@"
    kill "$sampler"
    cat "$OUT/$name.host" >> "$OUT/$name.log" 2>/dev/null
}

host_memory_peak() {  # name: the host memory held by the run (the processes whose command line holds
    # its own data cache path, and their descendants: workers, the fork server), shared pages counted once, each second
    # (tools/benchmarks/host_memory.py); the largest so far goes to $OUT/name.host, every reading to
    # $OUT/name.host_readings
    exec python3 tools/benchmarks/host_memory.py "$WORK/cache_$1 " --every 1 --output "$OUT/$1.host" > "$OUT/$1.host_readings"
}

fp8_flags() {  # recipe -> the FP8 flags of that recipe (none for bf16)
    [ "$1" = bf16 ] || echo "--fp8-format hybrid --fp8-recipe $1"
}

fp8_speed_run() {  # name ngpus: fp8_1p3b_<recipe>_mbs<N> (one GPU) or fp8_6p7b_tp2_<recipe>_mbs<N> (two GPUs),
    # optionally ending in _gbs<G> (the global batch; default 32 and 16); a recipe ending in -overlap
    # (bf16-overlap, delayed-overlap) adds --tp-comm-overlap
    local name=$1 ngpus=$2 recipe mbs gbs= overlap=() shape=$1
    [ "${shape%_gbs*}" != "$shape" ] && gbs=${shape##*_gbs} && shape=${shape%_gbs*}
    recipe=${shape%_mbs*}
    recipe=${recipe##*_}
    mbs=${shape##*_mbs}
    [ "${recipe%-overlap}" != "$recipe" ] && overlap=(--tp-comm-overlap) && recipe=${recipe%-overlap}
    if [ "$ngpus" = 1 ]; then
        NGPUS=1 ITERS=${ITERS_FP8:-12} LOG_INTERVAL=2 gpt_run "$name" 24 2048 16 bf16 "$mbs" "${gbs:-32}" \
            $(fp8_flags "$recipe")
    else
        NGPUS=2 ITERS=${ITERS_FP8:-12} LOG_INTERVAL=2 gpt_run "$name" 32 4096 32 bf16 "$mbs" "${gbs:-16}" \
            --tensor-model-parallel-size 2 --sequence-parallel --recompute-activations "${overlap[@]}" \
            $(fp8_flags "$recipe")
    fi
}

logs_starting_with() {  # prefix -> the runs in $OUT whose logs start with it, sorted (bf16 before FP8)
    local log
    for log in "$OUT/$1"*.log; do [ -f "$log" ] && basename "$log" .log; done
}

fp8_parity_run() {  # recipe: the 350M GPT's loss-parity run in bf16 ("bf16") or FP8 with that recipe
    SEQ=1024 ITERS=${PARITY_ITERS:-2000} LOG_INTERVAL=1 gpt_run "fp8_parity_$1" 24 1024 16 bf16 "${PARITY_GBS:-2}" \
        "${PARITY_GBS:-2}" \
        --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --eval-interval 200 --eval-iters 10 $(fp8_flags "$1")
}

fp8_parity_side_by_side() {  # the four parity runs at once, spread over GPU_IDS (default: every GPU); the
    # 350M at two sequences per iteration leaves room for several runs on one GPU
    local gpus index=0 recipe
    IFS=, read -ra gpus <<< "${GPU_IDS:-$(seq -s, 0 $(($(nvidia-smi --list-gpus | wc -l) - 1)))}"
    for recipe in bf16 delayed tensorwise rowwise; do
        GPU_IDS=${gpus[$((index % ${#gpus[@]}))]} MASTER_PORT=$((29600 + index)) fp8_parity_run "$recipe" > /dev/null &
        index=$((index + 1))
    done
    wait
}

fp8_parity() {  # each FP8 parity run against bf16's (tests/gpu/fp8_parity.py), and their curves (tools/plot_logs.py)
    local logs=() recipe
    for recipe in delayed tensorwise rowwise; do
        [ -f "$OUT/fp8_parity_$recipe.log" ] && logs+=("$OUT/fp8_parity_$recipe.log")
    done
    $py tests/gpu/fp8_parity.py "$OUT/fp8_parity_bf16.log" "${logs[@]}" | tee "$OUT/fp8_parity.txt" || status=1
    $py tools/plot_logs.py "$OUT/fp8_parity_bf16.log" "${logs[@]}" --out "$OUT/fp8_parity" --series loss,grad-norm \
        2>&1 | tee -a "$OUT/fp8_parity.txt"
}

run_lanes() {  # LANES="gpu_ids=run run...;gpu_ids=run...": each lane's runs in order, the lanes side by side
    local lane index=0 pids=()
    IFS=';' read -ra lanes <<< "$LANES"
    for lane in "${lanes[@]}"; do
        GPU_IDS=${lane%%=*} MASTER_PORT=$((29511 + 10 * index)) LANE=$index RUNS=${lane#*=} LANES= \
            bash "$0" > "$OUT/lane$index.log" 2>&1 &
        pids+=($!)
        index=$((index + 1))
    done
    for index in "${pids[@]}"; do wait "$index" || status=1; done
}

prepare_data || exit 1
[ -n "${LANES:-}" ] && run_lanes
for run in $RUNS; do
    if [ "${run%@h100}" != "$run" ]; then  # an 80 GB H100: the allocator capped (tests/gpu/memory_cap)
        run=${run%@h100}
        export GPU_MEMORY_MIB=${H100_ALLOCATOR_MIB:-80000} PYTHONPATH=$PWD/tests/gpu/memory_cap:$PYTHONPATH
    else
        unset GPU_MEMORY_MIB
    fi
    case $run in
        example) (N_GPUS=1 RUN_DIR=$WORK OUTPUT_DIR=$WORK/example bash examples/pretrain_gpt_deepspeed_single_node.sh) \
                     2>&1 | tee "$OUT/example.log" || status=1 ;;
        350m_bf16) gpt_run 350m_bf16 24 1024 16 bf16 8 64 ;;
        350m_fp16) gpt_run 350m_fp16 24 1024 16 fp16 8 64 ;;
        1p3b_bf16) gpt_run 1p3b_bf16 24 2048 16 bf16 8 32 ;;
        1p3b_fp16) gpt_run 1p3b_fp16 24 2048 16 fp16 8 32 ;;
        1p3b_mbs16) gpt_run 1p3b_mbs16 24 2048 16 bf16 16 32 ;;
        1p3b_mbs16_selective) gpt_run 1p3b_mbs16_selective 24 2048 16 bf16 16 32 --recompute-activations ;;
        1p3b_mbs16_mlp_act) gpt_run 1p3b_mbs16_mlp_act 24 2048 16 bf16 16 32 --recompute-granularity selective \
                                --recompute-modules mlp_act ;;
        1p3b_mbs16_mlp_act_block*) gpt_run "$run" 24 2048 16 bf16 16 32 --recompute-granularity selective \
                                       --recompute-modules mlp_act --recompute-method block \
                                       --recompute-num-layers "${run##*_block}" ;;
        1p3b_mbs16_layernorm) gpt_run 1p3b_mbs16_layernorm 24 2048 16 bf16 16 32 --recompute-granularity selective \
                                  --recompute-modules layernorm ;;
        1p3b_mbs16_core_attn) gpt_run 1p3b_mbs16_core_attn 24 2048 16 bf16 16 32 --recompute-granularity selective \
                                  --recompute-modules core_attn layernorm mlp_act ;;
        recompute_compare) recompute_table 1p3b_bf16 1p3b_mbs16_selective 1p3b_mbs16_mlp_act 1p3b_mbs16_layernorm \
                               1p3b_mbs16_core_attn $(logs_starting_with 1p3b_mbs16_mlp_act_block) 1p3b_mbs16 \
                               | tee "$OUT/recompute.txt" ;;
        ulysses_1gpu_[0-9]*k) kilo=${run#ulysses_1gpu_}; ulysses_run "$run" 1 $(( ${kilo%k} * 1024 )) ;;
        profile_ulysses_1gpu_[0-9]*k) kilo=${run#profile_ulysses_1gpu_}
                                      ITERS_ULYSSES=4 ulysses_run "$run" 1 $(( ${kilo%k} * 1024 )) \
                                          --tensorboard-dir "$OUT/$run" --profile --use-pytorch-profiler \
                                          --profile-step-start 3 --profile-step-end 4 --profile-ranks 0 ;;
        ulysses_s2_32k) ulysses_run ulysses_s2_32k 2 32768 --ds-sequence-parallel-size 2 ;;
        ulysses_s4_64k) ulysses_run ulysses_s4_64k 4 65536 --ds-sequence-parallel-size 4 ;;
        ulysses_s[24]_*k_*) ulysses_variant "$run" "$run" ;;
        profile_ulysses_s[24]_*k*) ITERS_ULYSSES=4 ulysses_variant "$run" "${run#profile_}" --tensorboard-dir "$OUT/$run" \
                                       --profile --use-pytorch-profiler --profile-step-start 3 --profile-step-end 4 \
                                       --profile-ranks 0 ;;
        ulysses_compare) recompute_table $(logs_starting_with ulysses_1gpu_) $(logs_starting_with ulysses_s2_) $(logs_starting_with ulysses_s4_) \
                             | tee "$OUT/ulysses.txt" ;;
        zero1_1p3b_dp2) NGPUS=2 ZERO_STAGE=1 LOG_INTERVAL=2 ITERS=12 gpt_run zero1_1p3b_dp2 24 2048 16 bf16 8 32 ;;
        zero3_1p3b_dp2) NGPUS=2 ZERO_STAGE=3 LOG_INTERVAL=2 ITERS=12 gpt_run zero3_1p3b_dp2 24 2048 16 bf16 8 32 ;;
        zero[13]_1p3b_dp2_mbs*) NGPUS=2 ZERO_STAGE=${run:4:1} LOG_INTERVAL=2 ITERS=12 gpt_run "$run" 24 2048 16 bf16 \
                                    "${run##*_mbs}" $((4 * ${run##*_mbs})) ;;
        zero3_compare) recompute_table zero1_1p3b_dp2 zero3_1p3b_dp2 $(logs_starting_with zero1_1p3b_dp2_mbs) \
                           $(logs_starting_with zero3_1p3b_dp2_mbs) | tee "$OUT/zero3.txt" ;;
        zero3_offload_2p7b) zero3_offload_run zero3_offload_2p7b 32 2560 32 ;;
        zero3_offload_6p7b) zero3_offload_run zero3_offload_6p7b 32 4096 32 ;;
        zero3_offload_13b) zero3_offload_run zero3_offload_13b 40 5120 40 ;;
        zero3_optoffload_6p7b) OFFLOAD_PARAM= zero3_offload_run zero3_optoffload_6p7b 32 4096 32 ;;
        zero3_offload_compare) recompute_table zero3_offload_2p7b zero3_offload_6p7b zero3_offload_13b \
                                   zero3_optoffload_6p7b | tee "$OUT/zero3_offload.txt" ;;
        peer_1p3b) LOG_INTERVAL=1 ITERS=12 gpt_run peer_1p3b 24 2048 16 bf16 8 32 ;;
        1p3b_checkpoint) rm -rf "$WORK/checkpoint_1p3b"
                         ITERS=3 LOG_INTERVAL=1 gpt_run 1p3b_checkpoint 24 2048 16 bf16 8 8 \
                             --lr-warmup-iters 1 --save "$WORK/checkpoint_1p3b" --save-interval 3 ;;
        peer_350m) LOG_INTERVAL=1 ITERS=12 gpt_run peer_350m 24 1024 16 bf16 16 64 ;;
        peer_1p3b_mbs16) LOG_INTERVAL=1 ITERS=12 gpt_run peer_1p3b_mbs16 24 2048 16 bf16 16 32 ;;
        peer_1p3b_mbs32) LOG_INTERVAL=1 ITERS=12 gpt_run peer_1p3b_mbs32 24 2048 16 bf16 32 32 ;;
        peer_350m_mbs32) LOG_INTERVAL=1 ITERS=12 gpt_run peer_350m_mbs32 24 1024 16 bf16 32 64 ;;
        llama1p2b_mbs1) llama_run llama1p2b_mbs1 1 ;;
        llama1p2b_mbs2) llama_run llama1p2b_mbs2 2 ;;
        llama1p2b_mbs4) llama_run llama1p2b_mbs4 4 ;;
        overflow) SCALE_POWER=24 HYSTERESIS=1 LOG_INTERVAL=1 ITERS=12 gpt_run overflow 4 1024 16 fp16 4 8 ;;
        layout_single) layout_run layout_single 1 ;;
        layout_dp2) layout_run layout_dp2 2 ;;
        layout_tp2) layout_run layout_tp2 2 --tensor-model-parallel-size 2 ;;
        layout_pp2) layout_run layout_pp2 2 --pipeline-model-parallel-size 2 ;;
        layout_compare) compare_layouts 1e-4 8 layout_single layout_dp2 layout_tp2 layout_pp2 \
                            | tee "$OUT/layouts.txt" || status=1 ;;
        6p7b_tp2pp2) big_run 6p7b_tp2pp2 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ;;
        6p7b_tp2dp2) big_run 6p7b_tp2dp2 4 --tensor-model-parallel-size 2 ;;
        6p7b_compare) compare_layouts 2e-2 5 6p7b_tp2pp2 6p7b_tp2dp2 | tee "$OUT/layouts_6p7b.txt" || status=1 ;;
        6p7b_tp2pp2_save) rm -rf "$WORK/checkpoint_6p7b"
                          big_run 6p7b_tp2pp2_save "${CKPT_NGPUS:-4}" --tensor-model-parallel-size 2 \
                              --pipeline-model-parallel-size 2 --save "$WORK/checkpoint_6p7b" --save-interval "${SAVE_AT:-30}" --exit-interval "${SAVE_AT:-30}" ;;
        6p7b_tp2pp2_resume) big_run 6p7b_tp2pp2_resume "${CKPT_NGPUS:-4}" --tensor-model-parallel-size 2 \
                                --pipeline-model-parallel-size 2 --load "$WORK/checkpoint_6p7b"
                            du -sh "$WORK/checkpoint_6p7b" | tee -a "$OUT/6p7b_tp2pp2_resume.log" ;;
        6p7b_resume_compare) $py tests/gpu/compare_logs.py resume --tolerance 5e-2 \
                                 $(logs_of 6p7b_tp2pp2 6p7b_tp2pp2_save 6p7b_tp2pp2_resume) \
                                 | tee "$OUT/resume_6p7b.txt" || status=1 ;;
        6p7b_tp2pp2_saving) rm -rf "$WORK/checkpoint_6p7b"
                            big_run 6p7b_tp2pp2_saving "${CKPT_NGPUS:-4}" --tensor-model-parallel-size 2 \
                                --pipeline-model-parallel-size 2 --save "$WORK/checkpoint_6p7b" --save-interval "${SAVE_AT:-30}" ;;
        6p7b_tp2pp2_rollback) echo "global_step${SAVE_AT:-30}" > "$WORK/checkpoint_6p7b/latest"
                              echo "${SAVE_AT:-30}" > "$WORK/checkpoint_6p7b/latest_checkpointed_iteration.txt"
                              big_run 6p7b_tp2pp2_rollback "${CKPT_NGPUS:-4}" --tensor-model-parallel-size 2 \
                                  --pipeline-model-parallel-size 2 --load "$WORK/checkpoint_6p7b" ;;
        6p7b_rollback_compare) $py tests/gpu/compare_logs.py resume --tolerance 5e-2 \
                                   $(logs_of 6p7b_tp2pp2_saving 6p7b_tp2pp2_saving 6p7b_tp2pp2_rollback) \
                                   | tee "$OUT/rollback_6p7b.txt" || status=1 ;;
        6p7b_tp2pp2dp2) big_run 6p7b_tp2pp2dp2 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ;;
        6p7b_tp4pp2) big_run 6p7b_tp4pp2 8 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 ;;
        6p7b_tp2pp4) big_run 6p7b_tp2pp4 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 ;;
        6p7b_tp2dp2_mbs4) big_fast_run 6p7b_tp2dp2_mbs4 --sequence-parallel ;;
        6p7b_tp2dp2_mbs4_overlap) big_fast_run 6p7b_tp2dp2_mbs4_overlap --sequence-parallel --tp-comm-overlap ;;
        6p7b_compare_8) compare_layouts 2e-2 5 6p7b_tp2pp2dp2 6p7b_tp4pp2 6p7b_tp2pp4 \
                            | tee "$OUT/layouts_6p7b_8gpu.txt" || status=1 ;;
        scale_1gpu) scale_run scale_1gpu 1 ;;
        scale_dp2) scale_run scale_dp2 2 ;;
        scale_tp2) scale_run scale_tp2 2 --tensor-model-parallel-size 2 ;;
        scale_tp2_sp) scale_run scale_tp2_sp 2 --tensor-model-parallel-size 2 --sequence-parallel ;;
        scale_tp2_overlap) scale_run scale_tp2_overlap 2 --tensor-model-parallel-size 2 --sequence-parallel \
                               --tp-comm-overlap ;;
        scale_pp2) scale_run scale_pp2 2 --pipeline-model-parallel-size 2 ;;
        scale_pp2_flops) scale_run scale_pp2_flops 2 --pipeline-model-parallel-size 2 --pp-partition-method flops ;;
        scale_tp2dp2) scale_run scale_tp2dp2 4 --tensor-model-parallel-size 2 ;;
        scale_tp2dp2_sp) scale_run scale_tp2dp2_sp 4 --tensor-model-parallel-size 2 --sequence-parallel ;;
        scale_tp2dp2_overlap) scale_run scale_tp2dp2_overlap 4 --tensor-model-parallel-size 2 --sequence-parallel \
                                  --tp-comm-overlap ;;
        scale_pp4) scale_run scale_pp4 4 --pipeline-model-parallel-size 4 ;;
        scale_pp4_flops) scale_run scale_pp4_flops 4 --pipeline-model-parallel-size 4 --pp-partition-method flops ;;
        profile_1gpu) profile_run profile_1gpu 1 ;;
        profile_zero1_dp2) ZERO_STAGE=1 profile_run profile_zero1_dp2 2 ;;
        profile_zero3_dp2) ZERO_STAGE=3 profile_run profile_zero3_dp2 2 ;;
        profile_bf16_1p3b) MBS_SCALE=16 profile_run profile_bf16_1p3b 1 ;;
        profile_fp8_1p3b) MBS_SCALE=16 profile_run profile_fp8_1p3b 1 $(fp8_flags delayed) ;;
        profile_tp2) profile_run profile_tp2 2 --tensor-model-parallel-size 2 ;;
        profile_tp2_sp) profile_run profile_tp2_sp 2 --tensor-model-parallel-size 2 --sequence-parallel ;;
        profile_tp2_overlap) profile_run profile_tp2_overlap 2 --tensor-model-parallel-size 2 --sequence-parallel \
                                 --tp-comm-overlap ;;
        universal_fp16) universal_runs fp16 ;;
        rel_bf16) reliability_runs bf16 ;;
        rel_fp16) reliability_runs fp16 ;;
        det_cost) ITERS=20 gpt_run det_cost_default 24 2048 16 bf16 4 32
                  ITERS=20 gpt_run det_cost_deterministic 24 2048 16 bf16 4 32 --deterministic ;;
        offload) ZERO_STAGE=2 OFFLOAD=1 ITERS=12 gpt_run offload_1p3b_bf16 24 2048 16 bf16 8 32 ;;
        w4096_mbs2) ITERS=20 gpt_run w4096_mbs2 16 4096 32 bf16 2 16 ;;
        w4096_mbs4) ITERS=20 LOG_INTERVAL=1 gpt_run w4096_mbs4 16 4096 32 bf16 4 16 ;;
        w4096_tp2) NGPUS=2 ITERS=20 LOG_INTERVAL=1 gpt_run w4096_tp2 16 4096 32 bf16 4 16 --tensor-model-parallel-size 2 ;;
        w4096_tp2_overlap) NGPUS=2 ITERS=20 LOG_INTERVAL=1 gpt_run w4096_tp2_overlap 16 4096 32 bf16 4 16 \
                               --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap ;;
        fp8_1p3b_compare) recompute_table $(logs_starting_with fp8_1p3b_) | tee "$OUT/fp8_1p3b.txt" ;;
        fp8_6p7b_compare) recompute_table $(logs_starting_with fp8_6p7b_tp2_) | tee "$OUT/fp8_6p7b.txt" ;;
        fp8_1p3b_*_mbs*) fp8_speed_run "$run" 1 ;;
        fp8_6p7b_tp2_*_mbs*) fp8_speed_run "$run" 2 ;;
        fp8_parity_compare) fp8_parity ;;
        fp8_parity_side_by_side) fp8_parity_side_by_side ;;
        fp8_parity_bf16|fp8_parity_delayed|fp8_parity_tensorwise|fp8_parity_rowwise) fp8_parity_run "${run#fp8_parity_}" ;;
        *) echo "unknown run $run" >&2; status=1 ;;
    esac
done
grep -h -E "^== | iteration +[0-9]+/" "$OUT"/*.log | tail -n 80 > "$OUT/summary.txt"
exit $status
