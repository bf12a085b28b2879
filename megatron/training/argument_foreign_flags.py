"""Flags of Megatron-LM and of Microsoft's Megatron-DeepSpeed, answered by name.

Launch scripts written for those two trainers pass flags that Megatron-DeepSpeed (BigScience) never
had. Each one gets an answer here instead of argparse's bare "unrecognized arguments":

* FOREIGN_ALIASES: another spelling of one of our flags, same dest and meaning
  (``--norm-epsilon`` is ``--layernorm-epsilon``);
* FOREIGN_SETTINGS: a switch that sets one of our flags to a fixed value
  (``--skip-train`` is ``--eval-only true``);
* FOREIGN_NO_OPS: a switch that asks for what this trainer always does (``--use-flash-attn``: torch's
  scaled_dot_product_attention already runs its flash kernel wherever it applies);
* FOREIGN_VALUE_FLAGS: a choice whose one accepted value is what this trainer does
  (``--transformer-impl local``); any other value is refused with the reason;
* FOREIGN_REFUSALS: everything else, refused with the reason of its category below (planned
  features, other model types, Megatron-LM machinery that DeepSpeed replaces here, Transformer
  Engine, NVIDIA infrastructure, inference, post-training, tokenizers, data, logging).

The refusals join argument_rejections.REJECTED_FLAGS; every flag is hidden from ``--help``. The flag
lists of both parsers are in tests/training/data/, and tests/training/test_foreign_flags.py checks
that each of them is accepted or answered with its reason. A flag that argument_groups.py defines is
never registered here: a feature that lands there takes its flag over, and its entry here goes.
"""
import argparse

from megatron.training.argument_types import ArgumentError

OTHER_MODEL = "this trainer pretrains GPT models only; remove the flag"
OWN_DDP = ("Megatron's own data parallelism is not used: DeepSpeed provides it (ZeRO stage in the "
           "ds_config's zero_optimization.stage); remove the flag")
OWN_PIPELINE = ("Megatron's own pipeline schedule is not used: DeepSpeed's pipeline engine runs "
                "1F1B; remove the flag")


def _planned(feature: str, meanwhile: str = "remove the flag") -> str:
    return f"is not available yet ({feature} are planned); {meanwhile}"


# ---- accepted ------------------------------------------------------------------------------------

FOREIGN_ALIASES = {
    "--norm-epsilon": "--layernorm-epsilon",
    "--kill-switch-file": "--kill-switch-path",
    "--distribute-saved-activations": "--distribute-checkpointed-activations",
    "--override-opt_param-scheduler": "--override-lr-scheduler",
    "--override-opt-param-scheduler": "--override-lr-scheduler",
    "--use-checkpoint-opt_param-scheduler": "--use-checkpoint-lr-scheduler",
    "--use-checkpoint-opt-param-scheduler": "--use-checkpoint-lr-scheduler",
    "--disable-log-loss-scale-to-tensorboard": "--no-log-loss-scale-to-tensorboard",
    "--deterministic-mode": "--deterministic",
}

FOREIGN_SETTINGS = {
    "--skip-train": ("--eval-only", True),
    "--apply-query-key-layer-scaling": ("--no-query-key-layer-scaling", True),
}

FOREIGN_NO_OPS = (
    # attention runs through torch's scaled_dot_product_attention, whose flash kernel serves every call
    # that dtype, head size and mask allow
    "--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2", "--use-flash-attn-triton",
    "--use-flash-attn-builder",
    "--no-persist-layer-norm", "--disable-mem-efficient-ln",  # no such layer-norm kernels are used
    "--ds_fused_adam",  # Adam is torch's fused AdamW on CUDA
    # the RMSNorm kernel already takes the residual's gradient in its backward; SwiGLU and rotary
    # embeddings run as torch operations
    "--fused-residual-rmsnorm", "--no-bias-swiglu-fusion", "--no-rope-fusion",
)

FOREIGN_VALUE_FLAGS = {
    "--transformer-impl": ("local", "Transformer Engine is not used: the layers are this trainer's own"),
}

# ---- refused: planned features ---------------------------------------------------------------------

_ROPE_VARIANT = ("is not available: rotary embeddings here rotate the two halves of each head (GPT-NeoX's and "
                 "Llama's layout) with --rotary-base, --rotary-percent and Llama 3's scaling (--use-rope-scaling); "
                 "remove the flag")
_ROPE_VARIANT_FLAGS = (
    "--no-position-embedding", "--no-rope-freq", "--no-yarn-correction-range-round-to-int", "--rope-type",
    "--rotary-interleaved", "--rotary-scaling-factor", "--rotary-seq-len-interpolation-factor",
    "--yarn-beta-fast", "--yarn-beta-slow", "--yarn-correction-range-round-to-int",
    "--yarn-original-max-position-embeddings",
)
# the rest of Megatron-LM's FP8 and FP4 flags (--fp8-format and its recipe flags are accepted)
_FP8_FLAGS = (
    "--disable-fp8-wgrad", "--fp4-format", "--fp4-param-gather", "--fp4-quantizer-factory", "--fp4-recipe",
    "--fp8-interval", "--fp8-output-proj", "--fp8-param-gather",
    "--fp8-quantizer-factory", "--keep-fp8-transpose-cache", "--no-fp8-wgrad",
    "--reuse-grad-buf-for-mxfp8-param-ag", "--te-precision-config-file",
)
_ULYSSES_FLAGS = (
    "--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size",
    "--ds-sequence-parallel-fpdt-offloading", "--force-ds-sequence-parallel",
)
_PLANNED = {
    **{flag: _ROPE_VARIANT for flag in _ROPE_VARIANT_FLAGS},
    **dict.fromkeys(_FP8_FLAGS, _planned("FP4 training and these FP8 options",
                                         "--fp8-format with --fp8-recipe runs the FP8 GEMMs")),
    "--fp8-e4m3": "is Megatron-LM's older spelling of --fp8-format e4m3: use that",
    "--fp8-hybrid": "is Megatron-LM's older spelling of --fp8-format hybrid: use that",
    **dict.fromkeys(_ULYSSES_FLAGS, _planned(
        "FPDT (chunked, offloaded Ulysses attention) and its options", "--ds-sequence-parallel-size S runs "
        "DeepSpeed-Ulysses")),
}

# ---- refused: other models and model variants ------------------------------------------------------

_MOE_FLAGS = (
    "--create-moe-param-group", "--disable-moe-token-dropping", "--disable-moe-top2-2nd-expert-sampling",
    "--enable-expert-tensor-parallelism", "--ep-overlap-early-attn-memory-release", "--expert-interval",
    "--expert-model-parallel-size", "--expert-tensor-parallel-num-weight-shards",
    "--expert-tensor-parallel-size", "--inference-moe-disable-fused-quant-kernels",
    "--inference-moe-token-dispatcher-type", "--mlp-type", "--moe-apply-probs-on-input", "--moe-aux-loss-coeff",
    "--moe-combine-bwd-dtype", "--moe-deepep-num-sms", "--moe-dispatch-fwd-dtype", "--moe-enable-deepep",
    "--moe-enable-routing-replay", "--moe-eval-capacity-factor", "--moe-expert-capacity-factor",
    "--moe-expert-parallel-size", "--moe-expert-rank-capacity-factor", "--moe-ffn-hidden-size",
    "--moe-flex-dispatcher-backend", "--moe-flex-dispatcher-num-sms", "--moe-grouped-gemm",
    "--moe-hybridep-num-blocks-permute", "--moe-hybridep-num-blocks-unpermute", "--moe-hybridep-num-sms",
    "--moe-hybridep-num-sms-preprocessing", "--moe-hybridep-pad-uneven-dispatch-inputs",
    "--moe-input-jitter-eps", "--moe-latent-size", "--moe-layer-freq", "--moe-layer-recompute",
    "--moe-loss-coeff", "--moe-min-capacity", "--moe-mlp-glu-interleave-size", "--moe-ncclep-zero-copy",
    "--moe-pad-expert-input-to-capacity", "--moe-pad-experts-for-cuda-graph-inference", "--moe-paged-stash",
    "--moe-paged-stash-buffer-size-factor-cpu", "--moe-paged-stash-buffer-size-factor-cuda",
    "--moe-paged-stash-page-size", "--moe-per-layer-logging", "--moe-permute-fusion",
    "--moe-permute-fusion-into-hybridep", "--moe-router-bias-update-rate", "--moe-router-dtype",
    "--moe-router-enable-expert-bias", "--moe-router-force-biased", "--moe-router-force-load-balancing",
    "--moe-router-fusion", "--moe-router-group-topk", "--moe-router-load-balancing-type",
    "--moe-router-num-groups", "--moe-router-padding-for-fp8", "--moe-router-padding-for-quantization",
    "--moe-router-pre-softmax", "--moe-router-quantile-balancing-ema", "--moe-router-score-function",
    "--moe-router-topk", "--moe-router-topk-scaling-factor", "--moe-routing-trace-capture-hidden-states",
    "--moe-routing-trace-capture-logits", "--moe-routing-trace-dump-weights",
    "--moe-routing-trace-max-training-iters", "--moe-routing-trace-path", "--moe-shared-expert-gate",
    "--moe-shared-expert-glu-interleave-size", "--moe-shared-expert-intermediate-size",
    "--moe-shared-expert-overlap", "--moe-single-grouped-bias", "--moe-single-grouped-weight",
    "--moe-token-dispatcher-type", "--moe-token-drop-policy", "--moe-train-capacity-factor",
    "--moe-upcycling-granularity", "--moe-use-grouped-tensor", "--moe-use-upcycling", "--moe-z-loss-coeff",
    "--num-experts", "--num-experts-switch", "--num-experts-teacher",
    "--overlap-dispatch-backward-with-experts-wgrad", "--overlap-moe-expert-parallel-comm",
    "--rl-inference-expert-model-parallel-size", "--rl-inference-expert-tensor-model-parallel-size", "--topk",
    "--use-fused-weighted-squared-relu", "--use-grouped-gemm-for-shared-expert", "--use-tutel",
)
_MODEL_TYPE_FLAGS = {
    "BERT": (
        "--bert-embedder-type", "--output-bert-embeddings",
    ),
    "T5 (encoder-decoder)": (
        "--decoder-num-layers", "--encoder-num-layers", "--pipeline-model-parallel-split-rank",
        "--relative-attention-max-distance", "--relative-attention-num-buckets",
    ),
    "Retro": (
        "--retro-add-retriever", "--retro-cyclic-train-iters", "--retro-encoder-attention-dropout",
        "--retro-encoder-hidden-dropout", "--retro-encoder-layers", "--retro-num-neighbors",
        "--retro-num-retrieved-chunks", "--retro-return-doc-ids", "--retro-workdir",
    ),
    "vision": (
        "--classes-fraction", "--data-per-class-fraction", "--dino-bottleneck-size",
        "--dino-freeze-last-layer", "--dino-head-hidden-size", "--dino-local-crops-number",
        "--dino-local-img-size", "--dino-norm-last-layer", "--dino-teacher-temp",
        "--dino-warmup-teacher-temp", "--dino-warmup-teacher-temp-epochs", "--img-h", "--img-w",
        "--iter-per-epoch", "--mask-factor", "--mask-type", "--swin-backbone-type",
        "--vision-backbone-type", "--vision-pretraining", "--vision-pretraining-type",
    ),
    "Mamba/hybrid": (
        "--disable-mamba-mem-eff-path", "--hybrid-layer-pattern", "--hybrid-override-pattern",
        "--is-hybrid-model", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads",
        "--mamba-state-dim", "--mamba-training-ssm-states-dtype",
    ),
    "multi-latent attention (MLA)": (
        "--kv-lora-rank", "--mla-down-proj-fusion", "--mscale", "--mscale-all-dim",
        "--multi-latent-attention", "--q-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
        "--v-head-dim",
    ),
    "multi-token prediction (MTP)": (
        "--mtp-detach-heads", "--mtp-hsm", "--mtp-hybrid-override-pattern", "--mtp-loss-scaling-factor",
        "--mtp-num-layers", "--mtp-standalone", "--mtp-use-repeated-layer",
    ),
    "DeepSeek sparse attention (DSA)": (
        "--disable-dsa-indexer-rotate-activation", "--disable-dsa-indexer-scoring-relu",
        "--dsa-indexer-head-dim", "--dsa-indexer-k-norm-epsilon", "--dsa-indexer-k-norm-fp32",
        "--dsa-indexer-loss-coeff", "--dsa-indexer-n-heads", "--dsa-indexer-rope-interleaved",
        "--dsa-indexer-skip-topk-offset", "--dsa-indexer-topk", "--dsa-indexer-topk-freq",
        "--dsa-indexer-use-sparse-loss", "--dsa-kernel-backend", "--no-dsa-indexer-rotate-activation",
        "--no-dsa-indexer-scoring-relu",
    ),
    "gated delta net / linear attention": (
        "--experimental-attention-variant", "--gdp-cutedsl-kernel", "--gdp-num-chunk-states-to-recompute",
        "--gdp-num-householder", "--linear-attention-freq", "--linear-conv-kernel-dim",
        "--linear-key-head-dim", "--linear-num-key-heads", "--linear-num-value-heads",
        "--linear-value-head-dim",
    ),
    "multimodal": (
        "--mrope-section",
    ),
}
_ARCHITECTURE_VARIANT_FLAGS = (
    "--activation-func-clamp-value", "--apply-layernorm-1p", "--attention-output-gate",
    "--enable-mhc-connections", "--glu-linear-offset", "--heterogeneous-layers-config-encoded-json",
    "--heterogeneous-layers-config-path", "--kitchen-attention-backend", "--mhc-init-gating-factor",
    "--mhc-num-residual-streams", "--mhc-recompute-layer-num", "--mhc-sinkhorn-iterations",
    "--mlp-chunks-for-training", "--mup-attn-scale-power", "--mup-base-head-dim", "--mup-base-hidden-size",
    "--mup-embedding-mult", "--mup-output-mult", "--mup-width-mult", "--qk-clip", "--qk-clip-alpha",
    "--qk-clip-threshold", "--qk-l2-norm", "--qk-layernorm", "--quick-geglu", "--random-ltd", "--softmax-type",
    "--spec", "--squared-relu", "--use-kitchen-attention", "--use-mup", "--window-attn-skip-freq", "--window-size",
)
_OTHER_MODELS = {
    **dict.fromkeys(_MOE_FLAGS, "is a mixture-of-experts option; this trainer pretrains dense GPT models; "
                                "remove the flag"),
    **{flag: f"is a {model_type} option; {OTHER_MODEL}"
       for model_type, flags in _MODEL_TYPE_FLAGS.items() for flag in flags},
    **dict.fromkeys(_ARCHITECTURE_VARIANT_FLAGS, "is a model-architecture option this trainer does not "
                                                 "implement; remove the flag"),
}

# ---- refused: Megatron-LM machinery that DeepSpeed replaces here -----------------------------------

_DDP_FLAGS = (
    "--create-all-gather-group", "--data-parallel-random-init", "--data-parallel-sharding-strategy",
    "--ddp-average-in-collective", "--ddp-bucket-size", "--ddp-num-buckets",
    "--ddp-pad-buckets-for-high-nccl-busbw", "--ddp-param-name-patterns-for-fp32-local-accumulation",
    "--ddp-reduce-scatter-with-fp32-accumulation", "--disable-align-grad-reduce",
    "--enable-full-sharding-in-hsdp", "--fsdp-db-use-persist-buf-on-alloc-fail", "--fsdp-double-buffer",
    "--fsdp-manual-registration", "--grad-reduce-in-bf16", "--gtp-expert-remat-nccl-ub", "--gtp-remat-nccl-ub",
    "--gtp-remat-opt-in-modules", "--gtp-remat-reduce-scatter-with-fp32-accumulation",
    "--init-model-with-meta-device", "--megatron-fsdp-enable-fine-grained-param-gather",
    "--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-main-params-dtype",
    "--megatron-fsdp-max-pool-double-buffer", "--megatron-fsdp-version", "--no-align-grad-reduce",
    "--no-align-param-gather", "--no-contiguous-buffers-in-local-ddp", "--no-gradient-reduce-div-fusion",
    "--no-use-layer-wise-param-layout", "--num-distributed-optimizer-instances", "--outer-dp-sharding-strategy",
    "--overlap-grad-reduce", "--overlap-param-gather", "--overlap-param-gather-with-optimizer-step",
    "--suggested-communication-unit-size", "--tensor-parallel-num-weight-shards",
    "--torch-fsdp2-no-reshard-after-forward", "--use-distributed-optimizer", "--use-megatron-fsdp",
    "--use-nccl-ub", "--use-torch-fsdp2",
)
_OPTIMIZER_WRAPPER_FLAGS = (
    "--dump-param-to-param-group-map", "--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-grads-dtype",
    "--main-params-dtype", "--no-pin-cpu-grads", "--no-pin-cpu-params", "--optimizer-cpu-offload",
    "--optimizer-cuda-graph", "--optimizer-offload-fraction", "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer", "--use-torch-optimizer-for-cpu-offload",
)
_PIPELINE_FLAGS = (
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
    "--defer-embedding-wgrad-compute", "--delay-wgrad-compute",
    "--microbatch-group-size-per-virtual-pipeline-stage", "--no-overlap-p2p-communication",
    "--num-virtual-stages-per-pipeline-rank", "--overlap-p2p-communication",
    "--overlap-p2p-communication-warmup-flush", "--pipeline-model-parallel-comm-backend",
    "--pipeline-model-parallel-layout", "--standalone-embedding-stage", "--use-ring-exchange-p2p",
    "--wgrad-deferral-limit",
)
_ZERO_BUBBLE_FLAGS = (
    "--enable-zbh1-exact-semantics", "--enable-zbh1-pipeline",
)
_CHECKPOINT_FORMAT_FLAGS = (
    "--async-ckpt-cpu-priority", "--async-ckpt-io-priority", "--async-ckpt-use-cpu-shm", "--async-save",
    "--async-strategy", "--auto-detect-ckpt-format", "--ckpt-assume-constant-structure",
    "--ckpt-convert-format", "--ckpt-convert-save", "--ckpt-convert-update-legacy-dist-opt-format",
    "--ckpt-drop-redundant-extra-state", "--ckpt-format", "--ckpt-fully-parallel-load",
    "--ckpt-fully-parallel-load-exchange-algo", "--ckpt-fully-parallel-load-per-rank-objects",
    "--ckpt-fully-parallel-load-process-group", "--ckpt-fully-parallel-save",
    "--ckpt-fully-parallel-save-process-group", "--ckpt-pg-tensors-cache-create",
    "--ckpt-pg-tensors-cache-path", "--disable-ckpt-load-validate-sharding-integrity",
    "--disable-strict-fsdp-dtensor-load", "--dist-ckpt-format", "--dist-ckpt-optim-fully-reshardable",
    "--dist-ckpt-save-pre-mcore-014", "--dist-ckpt-strictness", "--dist-ckpt-workers",
    "--distrib-optim-fully-reshardable-mem-efficient", "--no-ckpt-fully-parallel-save",
    "--no-ckpt-load-validate-sharding-integrity", "--no-strict-fsdp-dtensor-load", "--non-persistent-ckpt-type",
    "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-algo", "--non-persistent-local-ckpt-dir",
    "--non-persistent-save-interval", "--replication", "--replication-factor", "--replication-jump",
    "--use-dist-ckpt", "--use-persistent-ckpt-worker", "--verify-integrity",
)
_REPLACED_BY_DEEPSPEED = {
    **dict.fromkeys(_DDP_FLAGS, OWN_DDP),
    **dict.fromkeys(_OPTIMIZER_WRAPPER_FLAGS, (
        "Megatron-LM's optimizer wrapper is not used: DeepSpeed wraps the optimizer (offload through the "
        "ds_config's zero_optimization.offload_optimizer); remove the flag")),
    **dict.fromkeys(_PIPELINE_FLAGS, OWN_PIPELINE),
    **dict.fromkeys(_ZERO_BUBBLE_FLAGS, "the zero-bubble schedule is not available: DeepSpeed's pipeline "
                                        "engine runs 1F1B; remove the flag"),
    **dict.fromkeys(_CHECKPOINT_FORMAT_FLAGS, (
        "is an option of Megatron-LM's own checkpoint formats (distributed, async, local); checkpoints "
        "here are DeepSpeed's, committed atomically; remove the flag")),
}

# ---- refused: kernels, communication and infrastructure --------------------------------------------

_TRANSFORMER_ENGINE_FLAGS = (
    "--cuda-graph-impl", "--cuda-graph-modules", "--cuda-graph-scope", "--cuda-graph-warmup-steps",
    "--enable-cuda-graph", "--external-cuda-graph", "--te-rng-tracker", "--use-grouped-gemm-for-dense-mlp",
    "--use-te-activation-func", "--use-transformer-engine-op-fuser",
)
_TE_TP_OVERLAP_FLAGS = (
    "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad", "--disable-tp-comm-overlap-ag",
    "--disable-tp-comm-overlap-rs", "--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs",
    "--no-tp-comm-bulk-dgrad", "--no-tp-comm-bulk-wgrad", "--no-tp-comm-overlap-ag", "--no-tp-comm-overlap-rs",
    "--no-tp-comm-split-ag", "--no-tp-comm-split-rs", "--tp-comm-overlap-cfg", "--tp-comm-overlap-rs-dgrad",
)
_COMMUNICATION_TUNING_FLAGS = (
    "--disable-gloo-process-groups", "--disable-symmetric-registration", "--high-priority-a2a-comm-stream",
    "--high-priority-stream-groups", "--nccl-communicator-config-path", "--sharp-enabled-group",
    "--symmetric-ar-type", "--tp-comm-bootstrap-backend", "--use-sharp",
)
_INFRASTRUCTURE_FLAGS = (
    "--aml-data-download-path", "--app-tag-run-name", "--app-tag-run-version", "--calc-ft-timeouts",
    "--check-for-large-grads", "--check-for-spiky-loss", "--check-weight-hash-across-dp-replicas-interval",
    "--disable-flight-recorder-dump-on-timeout", "--disable-flight-recorder-extra-dump-on-exec",
    "--disable-flight-recorder-include-only-active", "--disable-straggler-on-startup", "--enable-ft-package",
    "--enable-msc", "--error-injection-rate", "--error-injection-type",
    "--fault-injector-delay-start-iteration", "--fault-injector-fault-delay",
    "--fault-injector-fault-probabilities", "--fault-injector-fault-types", "--fault-injector-mtti-seconds",
    "--fault-injector-num-ranks", "--fault-injector-offset-seconds", "--fault-injector-ranks",
    "--fault-injector-seed", "--flight-recorder-dump-path", "--flight-recorder-include-stack-trace",
    "--flight-recorder-trace-buffer-size", "--ft-num-warmup-iters", "--gpu-sniff-test-interval",
    "--inprocess-active-world-size", "--inprocess-barrier-timeout", "--inprocess-completion-timeout",
    "--inprocess-empty-cuda-cache", "--inprocess-granularity", "--inprocess-hard-timeout",
    "--inprocess-heartbeat-interval", "--inprocess-heartbeat-timeout", "--inprocess-last-call-wait",
    "--inprocess-max-iterations", "--inprocess-monitor-process-interval", "--inprocess-monitor-thread-interval",
    "--inprocess-progress-watchdog-interval", "--inprocess-restart", "--inprocess-soft-timeout",
    "--inprocess-termination-grace-time", "--log-straggler", "--no-flight-recorder-dump-on-timeout",
    "--no-flight-recorder-extra-dump-on-exec", "--no-flight-recorder-include-only-active", "--no-one-logger",
    "--one-logger-async", "--one-logger-project", "--one-logger-run-name", "--otel-enabled",
    "--otel-service-name", "--otel-span-groups", "--rerun-mode", "--result-rejected-tracker-filename",
    "--run-workload-inspector-server", "--straggler-ctrlr-port", "--straggler-minmax-count",
)
_ACTIVATION_OFFLOAD_FLAGS = (
    "--activation-offload-fraction", "--cpu-offloading-num-layers",
    "--cpu-offloading-retain-pinned-cpu-buffers", "--delay-offload-until-cuda-graph",
    "--delta-offload-bytes-across-pp-ranks", "--fine-grained-activation-offloading",
    "--fine-grained-offloading-max-inflight-offloads", "--min-offloaded-tensor-size", "--offload-modules",
)
_CONTEXT_PARALLEL_FLAGS = (
    "--context-parallel-size", "--cp-comm-type", "--hierarchical-context-parallel-sizes",
    "--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank",
)
_KERNELS_AND_INFRASTRUCTURE = {
    **dict.fromkeys(_TRANSFORMER_ENGINE_FLAGS, "is a Transformer Engine or CUDA-graph option; the layers "
                                               "here are this trainer's own; remove the flag"),
    **dict.fromkeys(_TE_TP_OVERLAP_FLAGS, (
        "tunes Transformer Engine's TP communication overlap; --tp-comm-overlap here is this trainer's "
        "own and has no such settings; remove the flag")),
    **dict.fromkeys(_COMMUNICATION_TUNING_FLAGS, "is a communication-tuning option this trainer does not "
                                                 "implement; remove the flag"),
    **dict.fromkeys(_INFRASTRUCTURE_FLAGS, (
        "is an option of NVIDIA's cluster tooling (one-logger, straggler detection, in-process restart, "
        "fault tolerance, fault injection, flight recorder, telemetry), not supported; remove the flag")),
    **dict.fromkeys(_ACTIVATION_OFFLOAD_FLAGS, "activation offloading is not supported "
                                               "(--checkpoint-activations saves activation memory); remove the flag"),
    **dict.fromkeys(_CONTEXT_PARALLEL_FLAGS, "context parallelism is not supported (DeepSpeed-Ulysses "
                                             "sequence parallelism is planned); remove the flag"),
}

# ---- refused: other workflows, tokenizers, data, logging, schedules --------------------------------

_INFERENCE_FLAGS = (
    "--cache-mla-latents", "--decode-only-cuda-graphs", "--ds-inference", "--enable-chunked-prefill",
    "--flash-decode", "--inference-batch-times-seqlen-threshold", "--inference-coordinator-port",
    "--inference-cuda-graph-all-prefills", "--inference-cuda-graph-max-tokens", "--inference-cuda-graph-scope",
    "--inference-disable-ep-consensus", "--inference-disable-triton-nvls-kernels",
    "--inference-dynamic-batching", "--inference-dynamic-batching-async-sched-mode",
    "--inference-dynamic-batching-block-size", "--inference-dynamic-batching-buffer-size-gb",
    "--inference-dynamic-batching-cuda-graph-mixed-prefill-count",
    "--inference-dynamic-batching-cuda-graph-sizing-distribution", "--inference-dynamic-batching-logprobs-mode",
    "--inference-dynamic-batching-mamba-memory-ratio", "--inference-dynamic-batching-max-requests",
    "--inference-dynamic-batching-max-tokens", "--inference-dynamic-batching-num-cuda-graphs",
    "--inference-dynamic-batching-paused-buffer-size-gb", "--inference-dynamic-batching-prefix-caching",
    "--inference-dynamic-batching-prefix-caching-coordinator-policy",
    "--inference-dynamic-batching-prefix-caching-eviction-policy",
    "--inference-dynamic-batching-prefix-caching-mamba-gb",
    "--inference-dynamic-batching-prefix-caching-routing-alpha",
    "--inference-dynamic-batching-sampling-backend",
    "--inference-dynamic-batching-track-generated-token-events",
    "--inference-dynamic-batching-track-paused-request-events",
    "--inference-dynamic-batching-unified-memory-level", "--inference-fuse-tp-communication",
    "--inference-grouped-gemm-backend", "--inference-logging-step-interval", "--inference-max-requests",
    "--inference-max-seq-length", "--inference-rng-tracker", "--inference-shards",
    "--inference-text-gen-server-logging", "--inference-use-synchronous-zmq-collectives",
    "--inference-wandb-logging", "--mamba-inference-conv-states-dtype", "--mamba-inference-ssm-states-dtype",
    "--max-tokens-to-oom", "--mlp-chunks-for-prefill", "--nccl-all-reduce-for-prefill",
    "--no-inference-disable-ep-consensus", "--no-inference-dynamic-batching-prefix-caching",
    "--no-inference-text-gen-server-logging", "--no-inference-use-synchronous-zmq-collectives",
    "--no-inference-wandb-logging", "--num-speculative-tokens", "--use-legacy-static-engine",
    "--use-same-sampling-seed-across-dp-ranks",
)
_POST_TRAINING_FLAGS = (
    "--chat-template", "--freeze-all-layers", "--grpo-clamp-eps-lower", "--grpo-clamp-eps-upper",
    "--grpo-entropy-term-weight", "--grpo-filter-groups-with-same-reward", "--grpo-group-size",
    "--grpo-iterations", "--grpo-kl-beta", "--grpo-prompts-per-step", "--head-lr-mult", "--hidden-size-teacher",
    "--kd", "--kd-alpha-ce", "--kd-beta-ce", "--kd-temp", "--langrl-env-config", "--load-teacher",
    "--logits-load-decode-threads", "--logits-load-dir", "--logits-load-ignore-errors",
    "--logits-load-kd-loss-alpha", "--logits-load-msc-prefetch-depth", "--logits-load-prefetch-factor",
    "--logits-save-dir", "--logits-save-dtype", "--logits-save-top-k", "--logits-save-top-p",
    "--logits-save-top-p-min-k", "--mos", "--no-rl-inference-logprobs-is-correction",
    "--no-rl-offload-inference-model-weights-when-idle", "--no-rl-partial-rollouts",
    "--no-rl-persist-cuda-graphs", "--no-rl-skip-bos-token", "--no-rl-training-cuda-graphs",
    "--no-rl-use-sequence-packing", "--no-rl-verify-model-weights-swap", "--num-attention-heads-teacher",
    "--num-layers-teacher", "--perform-rl-step", "--pretrained-checkpoint", "--refit-method",
    "--rl-consumption-granularity", "--rl-default-temperature", "--rl-default-top-k", "--rl-default-top-p",
    "--rl-durable-rollout-bank", "--rl-generation-lag", "--rl-importance-sampling-truncation-coef",
    "--rl-inference-logprobs-is-correction", "--rl-inference-model-unified-memory-level",
    "--rl-inference-parsers", "--rl-inference-pipeline-model-parallel-size",
    "--rl-inference-tensor-model-parallel-size", "--rl-kv-cache-management-mode", "--rl-max-inflight-requests",
    "--rl-offload-inference-model-weights-when-idle", "--rl-offload-optimizer-during-inference",
    "--rl-partial-rollouts", "--rl-persist-cuda-graphs", "--rl-profile", "--rl-profile-dir",
    "--rl-prompts-per-eval", "--rl-rollout-bank-dir", "--rl-rollout-bank-max-bytes",
    "--rl-sequence-packing-algo", "--rl-sequence-packing-max-sequences-per-bin", "--rl-skip-bos-token",
    "--rl-submission-granularity", "--rl-training-cuda-graphs", "--rl-use-sequence-packing",
    "--rl-verify-model-weights-swap", "--sft", "--sft-tokenizer-prompt-format",
)
_TOKENIZER_FLAGS = (
    "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces", "--null-tokenizer-eod-id",
    "--null-tokenizer-pad-id", "--tiktoken-num-special-tokens", "--tiktoken-pattern",
    "--tokenizer-hf-no-include-special-tokens", "--tokenizer-hf-no-use-fast", "--tokenizer-metadata",
    "--tokenizer-sentencepiece-legacy", "--tokenizer-special-tokens",
    "--trust-remote-code", "--use-gigatoken", "--vocab-size",
)
_FIM_FLAGS = (
    "--fim-data", "--fim-eod-token", "--fim-fragment-rate", "--fim-middle-token", "--fim-no-prefix",
    "--fim-pad-token", "--fim-prefix-token", "--fim-rate", "--fim-split-sample", "--fim-spm-rate",
    "--fim-suffix-token",
)
_SPLIT_PATH_FLAGS = (
    "--data-args-path", "--per-split-data-args-path", "--test-data-path", "--train-data-path",
    "--valid-data-path",
)
_DATA_FLAGS = (
    "--allow-ambiguous-pad-tokens", "--calculate-per-token-loss", "--dataloader-defer-npy-index-mmap",
    "--dataloader-fast-cache-load", "--dataloader-inter-document-masking", "--full-validation",
    "--mid-level-dataset-surplus", "--mock-data", "--multiple-validation-sets",
    "--no-create-attention-mask-in-dataloader", "--no-data-sharding", "--no-mmap-bin-files",
    "--num-dataset-builder-threads", "--object-storage-cache-path", "--per-dataset-sequences-path",
    "--repeated-dataloader", "--return-data-index", "--train-data-exact-num-epochs", "--train-desc-path",
    "--train-doc-idx-path", "--train-idx-path", "--train-sample-idx-path", "--train-shuffle-idx-path",
    "--use-dataset-only", "--validation-set-names",
)
_LOGGING_FLAGS = (
    "--config-logger-dir", "--log-device-memory-used", "--log-energy", "--log-max-attention-logit",
    "--log-memory-interval", "--log-memory-to-tensorboard", "--log-optimizer-states-to-tensorboard",
    "--log-progress", "--log-throughput", "--log-world-size-to-tensorboard", "--logging-level",
    "--memory-snapshot-path", "--no-barrier-with-level-1-timing", "--nvtx-ranges",
    "--pytorch-profiler-collect-callstack", "--pytorch-profiler-collect-chakra",
    "--pytorch-profiler-collect-shapes", "--record-memory-history", "--record-shapes",
    "--save-activations-interval", "--save-dgrads-interval", "--save-params-interval",
    "--save-tokens-per-expert-interval", "--save-wgrads-interval", "--timing-log-level", "--timing-log-option",
)
_OPTIMIZER_FLAGS = (
    "--lion-beta1", "--lion-beta2", "--muon-coefficient-type", "--muon-extra-scale-factor",
    "--muon-fp32-matmul-prec", "--muon-momentum", "--muon-nesterov", "--muon-no-split-qkv",
    "--muon-num-ns-steps", "--muon-scalar-optimizer", "--muon-scale-mode", "--muon-tp-mode", "--muon-use-syrk",
)
_WEIGHT_DECAY_SCHEDULE_FLAGS = (
    "--apply-wd-to-qk-layernorm", "--end-weight-decay", "--no-weight-decay-cond-type", "--start-weight-decay",
    "--weight-decay-incr-style",
)
_LR_SCHEDULE_FLAGS = (
    "--decoupled-lr", "--decoupled-min-lr", "--lr-warmup-init", "--lr-wsd-decay-iters",
    "--lr-wsd-decay-samples", "--lr-wsd-decay-style",
)
_CHECKPOINT_OPTION_FLAGS = (
    "--disable-save-tokenizer-assets", "--disable-use-tokenizer-model-from-checkpoint-args",
    "--exit-on-missing-checkpoint", "--load-main-params-from-ckpt", "--no-load-lr-state",
    "--no-save-tokenizer-assets", "--no-use-tokenizer-model-from-checkpoint-args", "--persistent-save-interval",
    "--save-retain-interval", "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args",
)
_NOT_IMPLEMENTED_FLAGS = (
    "--batch-invariant-backend", "--batch-invariant-mode", "--decrease-batch-size-if-needed",
    "--disable-bf16-reduced-precision-matmul", "--disable-clone-scatter-output-in-embedding",
    "--disable-jit-fuser", "--disable-manual-gc-eval", "--distributed-timeout-minutes",
    "--distributed-timeout-seconds-after-init", "--embedding-init-method-std", "--embedding-weights-in-fp32",
    "--empty-unused-memory-level", "--enable-experimental", "--eval-global-batch-size",
    "--eval-micro-batch-size", "--exit-signal-handler-for-dataloader", "--fake-process-group", "--manual-gc",
    "--manual-gc-interval", "--no-clone-scatter-output-in-embedding", "--no-initialization",
    "--no-manual-gc-eval", "--output-logit-dtype", "--phase-transition-iterations", "--start-eval-at-iter",
    "--step-batch-size-schedule", "--test-mode", "--train-sync-interval", "--use-tp-pp-dp-mapping", "--yaml-cfg",
)
_MISSING_FEATURES = {
    **dict.fromkeys(_INFERENCE_FLAGS, (
        "is an option of Megatron-LM's inference engine; text generation here is "
        "tools/generate_samples_gpt.py and tools/run_text_generation_server.py; remove the flag")),
    **dict.fromkeys(_POST_TRAINING_FLAGS, "is a post-training option (RL, SFT, distillation); this trainer "
                                          "pretrains; remove the flag"),
    **dict.fromkeys(_TOKENIZER_FLAGS, (
        "tokenizers here are GPT2BPETokenizer (--vocab-file, --merge-file), PretrainedFromHF "
        "(--tokenizer-name-or-path), HuggingFaceTokenizer and SentencePieceTokenizer (--tokenizer-model), "
        "without this option; remove the flag")),
    **dict.fromkeys(_FIM_FLAGS, "fill-in-the-middle samples are not supported; remove the flag"),
    **dict.fromkeys(_SPLIT_PATH_FLAGS, (
        "give each split's datasets with --train-weighted-split-paths, --valid-weighted-split-paths and "
        "--test-weighted-split-paths, or one --data-path with --split")),
    **dict.fromkeys(_DATA_FLAGS, "is a dataset option this trainer does not implement; remove the flag"),
    **dict.fromkeys(_LOGGING_FLAGS, "is a logging or profiling option this trainer does not implement "
                                    "(see --help, group logging); remove the flag"),
    **dict.fromkeys(_OPTIMIZER_FLAGS, "--optimizer offers adam and sgd; remove the flag"),
    **dict.fromkeys(_WEIGHT_DECAY_SCHEDULE_FLAGS, "--weight-decay is constant here; remove the flag"),
    **dict.fromkeys(_LR_SCHEDULE_FLAGS, (
        "--lr-decay-style offers constant, linear, cosine and inverse-square-root after a linear warmup "
        "from 0; remove the flag")),
    **dict.fromkeys(_CHECKPOINT_OPTION_FLAGS, "is a checkpoint option this trainer does not implement; "
                                              "remove the flag"),
    **dict.fromkeys(_NOT_IMPLEMENTED_FLAGS, "is not implemented by this trainer; remove the flag"),
}

_ALWAYS_SAVES_ON_SIGNALS = ("SIGTERM, SIGINT and SIGUSR1 always make this trainer save a checkpoint and "
                            "exit (--exit-signal-handler); remove the flag")
_ATTENTION_KERNEL = ("attention runs through torch's scaled_dot_product_attention, which picks its flash, "
                     "cuDNN or memory-efficient kernel itself (--deterministic forces the materialized "
                     "path); remove the flag")
_LOADS_LATEST = ("--load resumes from the checkpoint that its latest file names; loading another tag or "
                 "iteration is not supported; remove the flag")
_ALWAYS_PADDED = ("the vocabulary is always padded (--make-vocab-size-divisible-by x TP, or "
                  "--pad-vocab-size-to); remove the flag")
_NO_OP_IN_MEGATRON_LM = "had no effect in Megatron-LM; remove the flag"
_SPECIFIC_REASONS = {
    "--exit-signal": _ALWAYS_SAVES_ON_SIGNALS,
    "--exit-signal-handler-for-training": _ALWAYS_SAVES_ON_SIGNALS,
    "--attention-backend": _ATTENTION_KERNEL,
    "--flash-attention-version": _ATTENTION_KERNEL,
    "--load-tag": _LOADS_LATEST,
    "--ckpt-step": _LOADS_LATEST,
    "--no-pad-vocab-size": _ALWAYS_PADDED,
    "--disable-pad-vocab-size": _ALWAYS_PADDED,
    "--use-mcore-models": _NO_OP_IN_MEGATRON_LM,
    "--disable-msc": _NO_OP_IN_MEGATRON_LM,
    "--padded-vocab-size": "use --pad-vocab-size-to N, which pads the vocabulary to exactly N",
    "--iterations-to-skip": "use --skip-train-iteration-range START-END (100-100 skips iteration 100)",
    "--reset-iteration": "use --finetune to load the weights and start at iteration 0",
    "--override-ckpt-iteration": "use --finetune to load the weights and start at iteration 0",
    "--profile_steps": "use --profile --use-pytorch-profiler --profile-step-start S --profile-step-end E",
    "--wandb-entity": "the W&B entity comes from the WANDB_ENTITY environment variable; remove the flag",
    "--no-async-tensor-model-parallel-allreduce": (
        "the column-parallel backward always overlaps its all-reduce with the weight-gradient GEMM; "
        "remove the flag"),
    "--no-check-for-nan-in-loss-and-grad": (
        "NaN and Inf losses and gradient norms are always detected (--max-consecutive-nan-iterations); "
        "remove the flag"),
    "--no-pipeline-parallel": (
        "the engine follows from the layout (the pipeline module unless ZeRO stage 2, which needs PP 1); "
        "remove the flag"),
    "--cross-entropy-loss-fusion": "the vocab-parallel cross entropy has one implementation; remove the flag",
    "--cross-entropy-fusion-impl": "the vocab-parallel cross entropy has one implementation; remove the flag",
    "--data-efficiency-curriculum-learning": (
        "curriculum learning is the ds_config's curriculum_learning block (sequence length); DeepSpeed's "
        "data-efficiency library is not supported; remove the flag"),
}

FOREIGN_REFUSALS = {**_PLANNED, **_OTHER_MODELS, **_REPLACED_BY_DEEPSPEED, **_KERNELS_AND_INFRASTRUCTURE,
                    **_MISSING_FEATURES, **_SPECIFIC_REASONS}


class _AliasOf(argparse.Action):
    """Another spelling of the flag whose action is ``target``: same dest, nargs, type and choices."""

    def __init__(self, option_strings, dest, target, **kwargs):
        super().__init__(option_strings, target.dest, nargs=target.nargs, const=target.const,
                         default=argparse.SUPPRESS, type=target.type, choices=target.choices,
                         help=argparse.SUPPRESS, metavar=target.metavar)
        self.target = target

    def __call__(self, parser, namespace, values, option_string=None):
        self.target(parser, namespace, values, option_string)


class _Setting(argparse.Action):
    """A switch that sets ``dest`` to ``value``."""

    def __init__(self, option_strings, dest, value, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.value = value

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.value)


class _NoOp(argparse.Action):
    """A switch for what this trainer always does: accepted, nothing to record."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        pass


class _OnlyValue(argparse.Action):
    """A choice of which only ``accepted`` (any case) is what this trainer does; other values are refused."""

    def __init__(self, option_strings, dest, accepted, reason, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                         metavar=accepted)
        self.accepted, self.reason = accepted, reason

    def __call__(self, parser, namespace, values, option_string=None):
        if values.lower() != self.accepted.lower():
            raise ArgumentError(f"{option_string} {values}: {self.reason}; only {option_string} "
                                f"{self.accepted} is accepted")


def add_foreign_accepted_flags(parser) -> None:
    """Register FOREIGN_ALIASES, FOREIGN_SETTINGS, FOREIGN_NO_OPS and FOREIGN_VALUE_FLAGS (hidden), after
    the flags they refer to; a flag the parser already has is left to it."""
    group = parser.add_argument_group("foreign", "Megatron-LM and Microsoft Megatron-DeepSpeed spellings that "
                                      "are accepted (hidden; megatron/training/argument_foreign_flags.py)")
    known = parser._option_string_actions

    def add(flag, **kwargs):
        if flag not in known:
            group.add_argument(flag, **kwargs)

    for flag, ours in FOREIGN_ALIASES.items():
        add(flag, action=_AliasOf, target=known[ours])
    for flag, (ours, value) in FOREIGN_SETTINGS.items():
        add(flag, action=_Setting, dest=known[ours].dest, value=value)
    for flag in FOREIGN_NO_OPS:
        add(flag, action=_NoOp)
    for flag, (accepted, reason) in FOREIGN_VALUE_FLAGS.items():
        add(flag, action=_OnlyValue, accepted=accepted, reason=reason)
