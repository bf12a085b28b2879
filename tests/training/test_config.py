"""build_config: the typed, frozen TrainConfig derived from parsed flags and a tokenizer's vocabulary."""
import dataclasses
import json
import os

import pytest
import torch

from megatron.core.data.data_paths import DatasetGroup, GroupEntry, WeightedPrefix
from megatron.core.tokenizer import build_tokenizer
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.config import TrainConfig, build_config
from tests.training.test_arguments import TR11_DS_CONFIG, argv, tr11_argv, world

GPT2_VOCAB = 50257


def config_of(extra=(), drop=(), env=None, cuda=False, vocab=GPT2_VOCAB):
    parsed = parse_args(argv(extra, drop), env=env or {}, cuda_available=cuda)
    return build_config(parsed, vocab)


# Rules of the model and dataset configs: checked once, when build_config builds them (before any
# process group), each error naming its flags. A 100-token vocabulary leaves --pad-vocab-size-to free.
CONFIG_CASES = {
    "seq > max positions": (["--seq-length", "64"], (), None, ["--max-position-embeddings", "--seq-length"]),
    "alibi seq > max positions": (["--position-embedding-type", "alibi", "--seq-length", "64"], (), None,
                                  ["--max-position-embeddings", "--seq-length", "alibi"]),
    "rotary seq > max positions": (["--position-embedding-type", "rotary", "--seq-length", "64"], (), None,
                                   ["--max-position-embeddings", "--seq-length", "rotary"]),
    "query groups without gqa": (["--num-query-groups", "2"], (), None, ["--num-query-groups",
                                                                        "--group-query-attention"]),
    "gqa without groups": (["--group-query-attention"], (), None, ["--num-query-groups"]),
    "query groups not divisible by tp": (["--tensor-model-parallel-size", "4", "--group-query-attention",
                                          "--num-query-groups", "2"], (), world(4),
                                         ["--num-query-groups", "--tensor-model-parallel-size"]),
    "swiglu and another glu": (["--swiglu", "--glu-activation", "geglu"], (), None, ["--swiglu", "--glu-activation"]),
    "rotary flag and alibi": (["--use-rotary-position-embeddings", "--position-embedding-type", "alibi"], (), None,
                              ["--use-rotary-position-embeddings", "--position-embedding-type"]),
    "glu with fusion": (["--glu-activation", "swiglu"], (), None, ["--glu-activation", "--no-bias-gelu-fusion"]),
    "bad data path pairs": (["--data-path", "0.5", "/d/a", "0.5"], (), None, ["--data-path"]),
    "heads not divisible by tp": (["--tensor-model-parallel-size", "3", "--num-attention-heads", "4"], (), world(3),
                                  ["--num-attention-heads", "--tensor-model-parallel-size"]),
    "ffn not divisible by tp": (["--tensor-model-parallel-size", "4", "--ffn-hidden-size", "130"], (), world(4),
                                ["--ffn-hidden-size", "--tensor-model-parallel-size"]),
    "padded vocab not divisible by tp": (["--tensor-model-parallel-size", "3", "--num-attention-heads", "3",
                                          "--hidden-size", "48", "--pad-vocab-size-to", "256"], (), world(3),
                                         ["--pad-vocab-size-to", "--tensor-model-parallel-size"]),
    "pad vocab not multiple": (["--pad-vocab-size-to", "300"], (), None,
                               ["--pad-vocab-size-to", "--make-vocab-size-divisible-by"]),
    "hidden not divisible by heads": (["--num-attention-heads", "3"], (), None, ["--hidden-size", "--kv-channels"]),
    "partition without checkpointing": (["--partition-activations"], (), None,
                                        ["--partition-activations", "--checkpoint-activations"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_error_names_the_flags(case):
    extra, drop, env, words = CONFIG_CASES[case]
    with pytest.raises(ArgumentError) as info:
        config_of(extra, drop, env, vocab=100)
    for word in words:
        assert word in str(info.value), f"{case}: {word!r} missing from {info.value}"


LLAMA_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--rotary-base",
               "500000", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
               "--group-query-attention", "--num-query-groups", "2", "--use-rope-scaling"]


def test_llama_flags_build_a_llama_model_config():
    model = config_of(LLAMA_FLAGS).model
    assert (model.normalization, model.glu_activation, model.bias_gelu_fusion) == ("RMSNorm", "swiglu", False)
    assert (model.position_embedding_type, model.rotary_base, model.use_rope_scaling) == ("rotary", 500000.0, True)
    assert model.untie_embeddings_and_output_weights and not model.add_bias_linear and not model.qkv_bias
    assert model.num_query_groups == 2
    assert model.ffn_hidden_size == int(4 * model.hidden_size * 2 / 3 / 64) * 64  # Megatron-LM's --swiglu rule
    assert config_of(LLAMA_FLAGS + ["--ffn-hidden-size", "96"]).model.ffn_hidden_size == 96
    assert config_of(LLAMA_FLAGS + ["--add-qkv-bias"]).model.qkv_bias


def test_microsoft_megatron_deepspeed_spellings_of_llama_flags():
    ours = config_of(["--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rotary",
                      "--rotary-base", "500000", "--normalization", "RMSNorm"]).model
    theirs = config_of(["--num-key-value-heads", "2", "--use-rotary-position-embeddings",
                        "--rotary-position-embeddings-theta", "500000", "--normalization", "rmsnorm"]).model
    assert ours == theirs
    assert config_of(["--rope-theta", "500000", "--position-embedding-type", "rotary"]).model.rotary_base == 500000


def test_model_and_dataset_configs_are_built_once(monkeypatch):
    from megatron.core.data.gpt_dataset import GPTDatasetConfig
    from megatron.core.models.gpt.config import GPTModelConfig
    built = []
    for cls in (GPTModelConfig, GPTDatasetConfig):
        def counting(self, original=cls.__post_init__, name=cls.__name__):
            built.append(name)
            original(self)
        monkeypatch.setattr(cls, "__post_init__", counting)
    config_of()
    assert sorted(built) == ["GPTDatasetConfig", "GPTModelConfig"]


def test_parsing_leaves_the_flags_as_argparse_read_them():
    parsed = parse_args(argv(["--encoder-seq-length", "32"], ["--seq-length"]), env={}, cuda_available=False)
    assert parsed.flags.seq_length is None and parsed.derived.seq_length == 32
    with pytest.raises(AttributeError, match="read-only"):
        parsed.flags.seq_length = 64
    assert build_config(parsed, GPT2_VOCAB).model.seq_length == 32


def test_model_config_gets_the_padded_vocabulary_and_flag_values():
    config = config_of(["--glu-activation", "swiglu", "--no-bias-gelu-fusion", "--embed-layernorm",
                        "--use-cpu-initialization", "--hidden-dropout", "0", "--seed", "7"])
    model = config.model
    assert (model.padded_vocab_size, config.data.orig_vocab_size) == (50304, GPT2_VOCAB)
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length) == (2, 64, 4, 32)
    assert (model.ffn_hidden_size, model.kv_channels, model.max_position_embeddings) == (256, 16, 32)
    assert (model.glu_activation, model.bias_gelu_fusion, model.embed_layernorm) == ("swiglu", False, True)
    assert model.use_cpu_initialization and model.hidden_dropout == 0.0 and model.seed == 7
    assert model.params_dtype == torch.float32 and model.attention_impl == "sdpa"


def test_padding_depends_on_tp_unless_padded_to_a_size():
    assert config_of(["--tensor-model-parallel-size", "2"], env=world(2)).model.padded_vocab_size == 50432
    padded = config_of(["--tensor-model-parallel-size", "2", "--pad-vocab-size-to", "51200"], env=world(2))
    assert padded.model.padded_vocab_size == 51200
    with pytest.raises(ArgumentError, match="--pad-vocab-size-to"):
        config_of(["--pad-vocab-size-to", "50176"])


def test_real_tokenizer_vocabulary(gpt2_tokenizer_files):
    vocab_file, merge_file = gpt2_tokenizer_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    parsed = parse_args(argv(["--vocab-file", vocab_file, "--merge-file", merge_file]), env={}, cuda_available=False)
    config = build_config(parsed, tokenizer.vocab_size)
    assert config.data.orig_vocab_size == tokenizer.vocab_size
    assert config.model.padded_vocab_size % 128 == 0
    assert 0 <= config.model.padded_vocab_size - tokenizer.vocab_size < 128
    assert (config.data.vocab_file, config.data.merge_file) == (vocab_file, merge_file)


@pytest.mark.parametrize("extra, drop, warmup, decay", [
    (["--train-iters", "100", "--global-batch-size", "8", "--lr-warmup-iters", "10"], ["--train-samples"], 80, 800),
    (["--train-iters", "100", "--global-batch-size", "8", "--lr-decay-iters", "50"], ["--train-samples"], 0, 400),
    (["--train-iters", "100", "--global-batch-size", "8", "--lr-warmup-fraction", "0.25"], ["--train-samples"],
     200.0, 800),
    ([], (), 0, 1000),
    (["--lr-warmup-samples", "100", "--lr-decay-samples", "900"], (), 100, 900),
    (["--lr-warmup-fraction", "0.1"], (), 100.0, 1000),
])
def test_learning_rate_lengths_are_resolved_to_samples(extra, drop, warmup, decay):
    schedule = config_of(extra, drop).schedule
    assert (schedule.lr_warmup_steps, schedule.lr_decay_steps) == (warmup, decay)
    assert type(schedule.lr_warmup_steps) is type(warmup)


def test_schedule_keeps_the_stop_conditions_and_tokens():
    schedule = config_of(["--train-tokens", "10e6", "--lr-warmup-tokens", "1_000", "--lr-decay-tokens", "9e6",
                          "--lr-decay-style", "inverse-square-root", "--exit-interval", "50", "--eval-only",
                          "--load", "/ckpt", "--kill-switch-path", "/tmp/stop"]).schedule
    assert (schedule.train_samples, schedule.train_iters, schedule.train_tokens) == (1000, None, 10_000_000)
    assert (schedule.lr_warmup_tokens, schedule.lr_decay_tokens, schedule.lr_decay_style) == \
        (1000, 9_000_000, "inverse-square-root")
    assert (schedule.exit_interval, schedule.eval_only, schedule.kill_switch_path) == (50, True, "/tmp/stop")


def test_effective_values_come_from_the_ds_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "gradient_clipping": 0.25,
                                "fp16": {"enabled": True, "loss_scale_window": 500, "initial_scale_power": 12}}))
    config = config_of(["--deepspeed", "--deepspeed_config", str(path), "--clip-grad", "1.0"], env=world(2), cuda=True)
    assert (config.schedule.global_batch_size, config.optimizer.clip_grad) == (16, 0.25)
    precision = config.precision
    assert (precision.fp16, precision.params_dtype, precision.grad_accum_dtype) == (True, torch.float16, "fp16")
    assert (precision.loss_scale, precision.initial_loss_scale, precision.loss_scale_window) == (None, 4096.0, 500)
    assert (precision.hysteresis, precision.min_loss_scale) == (2, 1)
    assert config.deepspeed.config_path == str(path)
    # No stage in the config means stage 0, which fp16 runs as stage 1 (argument_ds_config.fp16_stage).
    assert config.parallel.distributed_backend == "nccl" and config.parallel.zero_stage == 1
    unfused = config_of(["--bf16", "--no-gradient-accumulation-fusion"], env=world(2), cuda=True)
    assert not unfused.precision.gradient_accumulation_fusion and unfused.precision.grad_accum_dtype == "fp32"


def test_parallel_config_from_slurm():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n[7-8]"}
    parallel = config_of(["--tensor-model-parallel-size", "2", "--zero-stage", "1"], env=env).parallel
    assert dataclasses.astuple(parallel) == (2, 1, 2, 4, 3, 1, "n7", 6000, "slurm", "gloo", False, 1,
                                             "type:transformer", False, 1)


def test_data_config_option_1():
    data = config_of(["--data-path", "0.3", "/d/a", "0.7", "/d/b", "--split", "98,2,0", "--data-cache-path",
                      "/cache", "--mmap-warmup", "--dataloader-type", "cyclic", "--eod-mask-loss"]).data
    dataset = data.dataset
    assert dataset.data_path == (WeightedPrefix(0.3, "/d/a"), WeightedPrefix(0.7, "/d/b"))
    assert dataset.split == (0.98, 0.02, 0.0) and (dataset.seq_length, dataset.seed) == (32, 1234)
    assert (dataset.data_cache_path, dataset.mmap_warmup, dataset.data_impl) == ("/cache", True, "infer")
    assert (data.dataloader_type, data.eod_mask_loss, data.reset_attention_mask) == ("cyclic", True, False)
    assert config_of().data.dataloader_type == "single"


def test_tr11_config(tmp_path):
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps(TR11_DS_CONFIG))
    parsed = parse_args(tr11_argv(tmp_path, str(ds_path)), env=world(8, rank=3), cuda_available=False)
    config = build_config(parsed, 250680)
    assert config.model.padded_vocab_size == 250880 and config.data.orig_vocab_size == 250680
    assert config.model.position_embedding_type == "alibi" and config.model.params_dtype == torch.bfloat16
    assert config.model.checkpoint_activations and config.abort_on_unmet_fused_kernel_constraints
    assert (config.parallel.pp_partition_method, config.parallel.rank) == ("type:transformer|embedding", 3)
    assert config.parallel.sync_tp_duplicated_parameters
    assert config.schedule.rampup_batch_size == (16, 16, 2000)
    assert (config.schedule.lr_warmup_steps, config.schedule.lr_decay_steps) == (216_320, 200_000_000)
    assert config.precision.grad_accum_dtype == "fp32" and config.parallel.zero_stage == 1
    assert config.precision.gradient_accumulation_fusion
    assert (config.optimizer.adam_beta2, config.optimizer.weight_decay, config.optimizer.lr) == (0.95, 0.1, 6e-5)
    assert (config.logging.tensorboard_queue_size, config.logging.log_validation_ppl_to_tensorboard) == (5, True)
    assert (config.logging.log_level, config.logging.log_level_replica) == ("info", "error")
    assert config.checkpoint.save_interval == 100 and config.checkpoint.no_load_optim is False
    dataset = config.data.dataset
    assert dataset.data_path == () and [g.name for g in dataset.valid_groups] == ["valid-en", "valid-fr"]
    assert dataset.train_groups == (DatasetGroup("train", (GroupEntry(1.0, 0.0, 0.95, "/data/en/en_text_document"),
                                                           GroupEntry(0.5, 0.0, 0.95, "/data/fr/fr_text_document"))),)
    assert config.data.valid_num_workers == 0 and config.data.tokenizer_type == "PretrainedFromHF"
    assert any("stage 0 -> 1" in notice for notice in config.notices)


def test_config_is_frozen_and_the_ds_config_is_handed_as_a_copy():
    config = config_of()
    assert isinstance(config, TrainConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.schedule.global_batch_size = 4
    handed = config.deepspeed.config_for_initialize()
    handed["train_batch_size"] = 999
    assert config.deepspeed.config["train_batch_size"] == 2 and config.deepspeed.config_path is None


def test_logging_and_checkpoint_flags(tmp_path):
    save, load, logs = (str(tmp_path / name) for name in ("ckpt", "init", "logs"))
    config = config_of(["--codecarbon-dir", str(tmp_path / "cc"), "--no-log-learnig-rate-to-tensorboard",
                        "--log-params-norm", "--save", save, "--save-interval", "10", "--no-load-rng",
                        "--finetune", "--load", load, "--log-path", logs])
    assert config.logging.codecarbon_dir == str(tmp_path / "cc") and config.logging.log_params_norm
    assert not config.logging.log_learning_rate_to_tensorboard and config.logging.log_loss_scale_to_tensorboard
    assert config.logging.log_path == logs
    assert dataclasses.astuple(config.checkpoint) == (save, load, 10, False, True, False, True, False, False, (), None, (),
                                                      False)


def test_wandb_flags_and_the_run_directory(tmp_path):
    pytest.importorskip("wandb", reason="--wandb-project needs wandb (the 'wandb' extra)")
    save = str(tmp_path / "ckpt")
    logging = config_of(["--wandb-project", "p", "--save", save, "--save-interval", "10"]).logging
    assert (logging.wandb_project, logging.wandb_exp_name, logging.wandb_save_dir) == \
        ("p", None, os.path.join(save, "wandb"))
    logging = config_of(["--wandb-project", "p", "--wandb-exp-name", "run", "--wandb-save-dir", str(tmp_path)]).logging
    assert (logging.wandb_exp_name, logging.wandb_save_dir) == ("run", str(tmp_path))
    assert config_of().logging.wandb_save_dir is None


def test_every_config_field_is_documented():
    import megatron.training.config as module
    for cls in (module.ParallelConfig, module.DataConfig, module.OptimizerConfig, module.ScheduleConfig,
                module.CheckpointConfig, module.LoggingConfig, module.PrecisionConfig, module.DeepSpeedSettings,
                module.TrainConfig, module.TokenizerConfig, module.InferenceConfig):
        docs = "".join(base.__doc__ for base in cls.__mro__ if dataclasses.is_dataclass(base))
        for field in dataclasses.fields(cls):
            assert field.name in docs, f"{cls.__name__}.{field.name} is not documented"


def test_skip_ranges_are_sorted_and_merged():
    schedule = config_of(["--skip-train-iteration-range", "40-40", "10-20", "15-30", "31-33"]).schedule
    assert schedule.skip_train_iteration_ranges == ((10, 33), (40, 40))
    assert config_of().schedule.skip_train_iteration_ranges == ()
    assert (config_of().schedule.max_consecutive_nan_iterations, config_of().schedule.lr_scheduler_source) == (20, "check")


@pytest.mark.parametrize("value", ["20-10", "0-5", "10", "a-b", "10-", "1-2-3"])
def test_a_bad_skip_range_is_named(value):
    with pytest.raises(ArgumentError, match=f"--skip-train-iteration-range: '{value}'"):
        config_of(["--skip-train-iteration-range", "1-2", value])


def test_save_interval_ranges_choose_the_interval_in_force(tmp_path):
    checkpoint = config_of(["--save", str(tmp_path), "--save-interval", "1500", "--save-interval-ranges", "101-1000:50",
                            "1-100:10"]).checkpoint
    assert checkpoint.save_interval_ranges == ((1, 100, 10), (101, 1000, 50))
    due = [iteration for iteration in range(1, 4501) if checkpoint.save_due(iteration)]
    assert due == list(range(10, 101, 10)) + list(range(150, 1001, 50)) + [1500, 3000, 4500]
    assert not config_of().checkpoint.save_due(1500)


@pytest.mark.parametrize("values, message", [
    (["1-100"], "is not START-END:INTERVAL"), (["1-100:0"], "is not START-END:INTERVAL"),
    (["1-100:10", "50-200:20"], "overlap at iteration 50"), (["100-1:10"], "1 <= START <= END"),
])
def test_bad_save_interval_ranges_are_named(values, message, tmp_path):
    with pytest.raises(ArgumentError, match=message):
        config_of(["--save", str(tmp_path), "--save-interval", "10", "--save-interval-ranges", *values])


def test_retention_flags_need_save():
    with pytest.raises(ArgumentError, match="need --save"):
        config_of(["--keep-last-checkpoints", "3"])


def test_deterministic_computes_attention_through_the_materialized_path():
    config = config_of(["--deterministic"])
    assert config.parallel.deterministic and config.model.attention_impl == "materialized"
    assert config_of().model.attention_impl == "sdpa" and not config_of().parallel.deterministic
