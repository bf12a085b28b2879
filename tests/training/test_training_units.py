"""Unit tests of the trainer's pieces: reductions, optimizer groups, gradient clipping, data delivery,
checkpoint state and stop conditions."""
import dataclasses
import importlib.util
import math
import multiprocessing
import pickle
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt import GPTModel, GPTModelConfig
from megatron.core.parallel_state import initialize_model_parallel, single_rank_groups
from megatron.core.tensor_parallel import get_rng_tracker, model_parallel_seed
from megatron.training import dist_utils
from megatron.training.checkpoint_checks import CheckpointError, _check_compatible
from megatron.training.checkpointing import TrainingProgress, client_state, restore_rng_states, rng_states
from megatron.training.config import CheckpointConfig, DataConfig
from megatron.training.data_loading import (DataLoadingError, LoaderSettings, cycling_iterator, get_batch,
                                            pipeline_batch, train_valid_test_num_samples, training_iterator)
from megatron.training.engine.deepspeed_engine import EngineSetupError, check_engine_grid
from megatron.training.engine.fp32_steps import gradient_norm_share
from megatron.training.engine.model_setup import (build_optimizer, parameter_counts, uses_pipeline_engine,
                                                  weight_decay_groups)
from megatron.training.training import exit_label
from tests.conftest import REPO_ROOT
from tests.dist_utils import run_distributed
from tests.training.test_config import config_of

EOD = 9


def tiny_model(**overrides):
    model_parallel_seed(1, 0, 0)
    config = GPTModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, padded_vocab_size=64, seq_length=8,
                            max_position_embeddings=8, embed_layernorm=True, **overrides)
    return GPTModel(config, single_rank_groups())


# ---------------------------------------------------------------------------------------- dist_utils


def test_reductions_are_identities_without_torch_distributed():
    assert not dist.is_initialized()
    assert dist_utils.average_across_group([1.5, -2.0]) == [1.5, -2.0]
    assert dist_utils.max_across_ranks(3.0) == 3.0
    assert dist_utils.any_rank_true(False) is False and dist_utils.any_rank_true(True) is True
    assert dist_utils.is_rank_0() and dist_utils.is_last_rank()
    dist_utils.barrier()


def _reductions_worker(rank, world_size):
    assert dist_utils.average_across_group([float(rank), 10.0 * rank]) == pytest.approx([0.5, 5.0])
    assert dist_utils.sum_across_group([1.0, rank]) == [2.0, 1.0]
    assert dist_utils.max_across_ranks(60.0 + rank) == 61.0
    assert dist_utils.any_rank_true(rank == 1) is True
    assert dist_utils.any_rank_true(False) is False
    assert dist_utils.is_last_rank() == (rank == 1)
    # a 2**53-sized counter survives the float64 reduction exactly
    assert dist_utils.sum_across_group([2.0 ** 52])[0] == 2.0 ** 53
    nan = dist_utils.average_across_group([math.nan if rank == 0 else 1.0])[0]
    assert math.isnan(nan)


@pytest.mark.distributed
def test_reductions_across_two_ranks():
    run_distributed(_reductions_worker, 2)


def _params_norm_worker(rank, world_size):
    """TP=2: a split weight holds half of [3, 4] on each rank; a replicated bias [12] is on both; a
    second tied copy must not count. ||(3, 4, 12)|| = 13."""
    split = torch.nn.Parameter(torch.tensor([3.0, 4.0])[rank:rank + 1])
    split.tensor_model_parallel = True
    replicated = torch.nn.Parameter(torch.tensor([12.0]))
    copy = torch.nn.Parameter(torch.tensor([100.0]))
    named = [("w", split), ("b", replicated), ("tied_modules.embed.w", copy)]
    norm = dist_utils.params_l2_norm(named, tp_rank=rank, data_parallel_size=1,
                                     counts_here=lambda name: not name.startswith("tied_modules."))
    assert norm == pytest.approx(13.0)


@pytest.mark.distributed
def test_params_norm_counts_each_parameter_once():
    run_distributed(_params_norm_worker, 2)


# ---------------------------------------------------------------------------------------- engine pieces


def test_weight_decay_skips_biases_and_norm_weights():
    model = tiny_model()
    decay, no_decay = weight_decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert all(name.endswith("weight") and "layernorm" not in name for name in decayed)
    assert "embedding.word_embeddings.weight" in decayed and "embedding.position_embeddings.weight" in decayed
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert {"final_layernorm.weight", "embedding.embed_layernorm.weight", "layers.0.mlp.dense_4h_to_h.bias"} \
        <= not_decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_adamw_is_decoupled_weight_decay():
    model = tiny_model()
    optimizer = build_optimizer(model, SimpleNamespace(optimizer="adam", lr=0.1, weight_decay=0.5, adam_beta1=0.9,
                                                       adam_beta2=0.95, adam_eps=1e-8, use_bnb_optimizer=False))
    assert isinstance(optimizer, torch.optim.AdamW)
    weight = model.final_layernorm.weight
    matrix = model.layers[0].mlp.dense_h_to_4h.weight
    before_norm, before_matrix = weight.detach().clone(), matrix.detach().clone()
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    torch.testing.assert_close(weight.detach(), before_norm)  # no decay on a norm weight
    torch.testing.assert_close(matrix.detach(), before_matrix * (1 - 0.1 * 0.5))  # p <- p (1 - lr wd)


def test_pipeline_engine_unless_zero_2():
    assert uses_pipeline_engine(1, 0) and uses_pipeline_engine(1, 1) and uses_pipeline_engine(4, 1)
    assert not uses_pipeline_engine(1, 2)


def test_gradient_norm_share_counts_split_replicated_and_tied_copies():
    split, replicated, tied_copy = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    split.tensor_model_parallel = True
    tied_copy.ds_pipe_replicated = True
    split.grad, replicated.grad, tied_copy.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0, 0.0]), \
        torch.tensor([5.0, 5.0])
    assert gradient_norm_share([split, replicated, tied_copy], tp_rank=0) == pytest.approx(169.0)
    assert gradient_norm_share([split, replicated, tied_copy], tp_rank=1) == pytest.approx(25.0)


def test_parameter_counts_distinct_share():
    model = tiny_model()
    total, without_embeddings = parameter_counts(model)
    assert total == sum(p.numel() for p in model.parameters())
    embeddings = model.embedding.word_embeddings.weight.numel() + model.embedding.position_embeddings.weight.numel()
    assert without_embeddings == total - embeddings
    assert parameter_counts(model, distinct_for=single_rank_groups()) == (total, without_embeddings)


def _grid_worker(rank, world_size):
    groups = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    good = SimpleNamespace(get_stage_id=lambda: 0, get_data_parallel_id=lambda: 0,
                           get_slice_parallel_rank=lambda: rank, dp_group=[rank], pp_group=[rank], slice_group=[0, 1])
    check_engine_grid(SimpleNamespace(grid=good), groups)
    swapped = SimpleNamespace(**{**vars(good), "get_slice_parallel_rank": lambda: 1 - rank})
    with pytest.raises(EngineSetupError, match="tensor rank"):
        check_engine_grid(SimpleNamespace(grid=swapped), groups)


@pytest.mark.distributed
def test_engine_grid_must_equal_ours():
    run_distributed(_grid_worker, 2)


# ---------------------------------------------------------------------------------------- data delivery


def _data_config(**flags):
    values = dict(dataset=None, tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file=None,
                  tokenizer_name_or_path=None, tokenizer_model=None, orig_vocab_size=64, dataloader_type="single", num_workers=0,
                  valid_num_workers=0, eod_mask_loss=False, reset_position_ids=False, reset_attention_mask=False)
    return DataConfig(**{**values, **flags})


def test_batch_shifts_text_and_applies_the_mask_flags():
    text = torch.tensor([[5, 6, EOD, 7, 8, 4, 3]])  # s + 1 = 7 tokens
    plain = get_batch({"text": text}, EOD, _data_config(), torch.device("cpu"))
    torch.testing.assert_close(plain.tokens, text[:, :-1])
    torch.testing.assert_close(plain.labels, text[:, 1:])
    assert plain.attention_mask is None and plain.loss_mask.tolist() == [[1.0] * 6]
    assert plain.position_ids.tolist() == [[0, 1, 2, 3, 4, 5]]
    reset = get_batch({"text": text}, EOD, _data_config(eod_mask_loss=True, reset_position_ids=True,
                                                        reset_attention_mask=True), torch.device("cpu"))
    assert reset.loss_mask.tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]]
    assert reset.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert reset.attention_mask.shape == (1, 1, 6, 6) and bool(reset.attention_mask[0, 0, 3, 2])
    inputs, labels = pipeline_batch(reset)
    assert len(inputs) == 3 and inputs[2] is reset.attention_mask and labels == (reset.labels, reset.loss_mask)
    assert len(pipeline_batch(plain)[0]) == 2


def test_batch_checks_token_ids_on_the_host_before_the_copy():
    """The embedding reads back only CPU ids (a GPU read-back would stall every forward): the batch
    function checks the loader's tensor, labels included, against the padded vocabulary."""
    text = torch.tensor([[5, 6, EOD, 7, 8, 4, 3]])
    vocab_size = max(EOD, 8) + 1
    assert get_batch({"text": text}, EOD, _data_config(), torch.device("cpu"), vocab_size).tokens.shape == (1, 6)
    for bad in (vocab_size, -1):
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {vocab_size}\).*got min"):
            get_batch({"text": torch.tensor([[5, 6, bad]])}, EOD, _data_config(), torch.device("cpu"), vocab_size)


def test_num_samples_per_split_as_megatron_deepspeed_asks():
    assert train_valid_test_num_samples(100, 8, None, 10, 2) == (800, (100 // 10 + 1) * 2 * 8, 16)
    assert train_valid_test_num_samples(100, 8, 1000, 10, 2)[0] == 1000


def _dataset(size):
    return [{"text": np.full(3, i, dtype=np.int64)} for i in range(size)]


def _ids(batches):
    return [batch["text"][:, 0].tolist() for batch in batches]


def test_training_iterator_starts_at_consumed_samples_and_reports_exhaustion():
    settings = LoaderSettings("single", micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2,
                              num_workers=0, seed=1)
    iterator = training_iterator(_dataset(10), 4, settings)
    assert _ids([next(iterator)]) == [[6, 7]]  # rank 1 of the global micro batch [4, 8); [8, 12) is incomplete
    with pytest.raises(DataLoadingError, match="exhausted"):
        next(iterator)


def test_validation_iterator_cycles_from_sample_zero():
    settings = LoaderSettings("single", micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1,
                              num_workers=0, seed=1)
    iterator = cycling_iterator(_dataset(5), 2, settings, "valid")
    assert _ids([next(iterator) for _ in range(4)]) == [[2, 3], [0, 1], [2, 3], [0, 1]]  # the tail [4] is dropped
    with pytest.raises(DataLoadingError, match="less than one micro batch"):
        next(cycling_iterator(_dataset(1), 0, settings, "valid"))


def test_loader_workers_end_at_each_new_epoch_and_at_close():
    """Workers ignore the exit signals, so no loader may be left to garbage collection: one epoch's
    workers end when the next epoch's loader starts, and close() ends the last ones."""
    settings = LoaderSettings("single", micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1,
                              num_workers=1, seed=1)
    before = set(multiprocessing.active_children())
    iterator = cycling_iterator(_dataset(4), 0, settings, "valid")
    epochs = [_ids([next(iterator), next(iterator)]) for _ in range(3)]
    assert epochs == [[[0, 1], [2, 3]]] * 3
    assert len(set(multiprocessing.active_children()) - before) == 1  # this epoch's worker only
    iterator.close()
    assert set(multiprocessing.active_children()) == before
    training = training_iterator(_dataset(4), 0, settings)
    assert _ids([next(training), next(training)]) == [[0, 1], [2, 3]]
    with pytest.raises(DataLoadingError, match="exhausted"):
        next(training)  # the exhausted training data closes its loader itself
    assert set(multiprocessing.active_children()) == before


def _resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads resident memory from /proc")
def test_loader_workers_do_not_map_the_trainers_memory():
    """A worker forked from the trainer would map (copy-on-write) every page the trainer held, its
    optimizer states under CPU offload: the workers start from a fork server instead."""
    settings = LoaderSettings("single", micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1,
                              num_workers=1, seed=1)
    ballast = torch.ones(1536, 1024, 1024, dtype=torch.uint8)  # 1.5 GiB resident in this process
    before = set(multiprocessing.active_children())
    iterator = training_iterator(_dataset(4), 0, settings)
    assert _ids([next(iterator)]) == [[0, 1]]
    (worker,) = set(multiprocessing.active_children()) - before
    assert _resident_mib(worker.pid) < 1024 < _resident_mib(os.getpid())
    iterator.close()
    del ballast


def test_cyclic_loader_reshuffles_each_epoch_and_keeps_the_default_rng():
    settings = LoaderSettings("cyclic", micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1,
                              num_workers=0, seed=3)
    torch.manual_seed(0)
    expected_draw = torch.rand(1)
    torch.manual_seed(0)
    iterator = training_iterator(_dataset(4), 0, settings)
    epochs = [sum(_ids([next(iterator), next(iterator)]), []) for _ in range(3)]
    assert all(sorted(epoch) == [0, 1, 2, 3] for epoch in epochs)  # every sample once per epoch
    assert len({tuple(epoch) for epoch in epochs}) > 1  # in another order
    torch.testing.assert_close(torch.rand(1), expected_draw)  # loaders use their own generators


# ---------------------------------------------------------------------------------------- checkpoint state


def _train_config(**model_overrides):
    """A TrainConfig of real flags, with the tiny model and a 50-token tokenizer."""
    config = config_of()
    return dataclasses.replace(config, model=tiny_model(**model_overrides).config,
                               data=dataclasses.replace(config.data, orig_vocab_size=50))


def test_client_state_holds_counters_version_vocab_and_rng():
    config = _train_config()
    progress = TrainingProgress(iteration=7, consumed_train_samples=28, consumed_train_tokens=224,
                                consumed_valid_samples=8)
    state = client_state(progress, config, pipeline=True)
    assert state["iteration"] == 7 and state["tokens"] == 224 and state["consumed_valid_samples"] == 8
    assert state["checkpoint_version"] == 3.0
    assert state["checkpoint_info"] == {"padded_vocab_size": 64, "original_vocab_size": 50}
    saved = state["args"]["config"]
    assert saved["optimizer"]["lr"] == config.optimizer.lr and saved["model"]["params_dtype"] == "torch.float32"
    assert saved["schedule"]["global_batch_size"] == config.schedule.global_batch_size
    assert pickle.loads(pickle.dumps(saved)) == saved  # plain values only
    assert "rng_tracker_states" in state
    assert state["universal_checkpoint_info"]["original_vocab_size"] == 50
    _check_compatible(state, config, "ckpt", universal=False)
    with pytest.raises(CheckpointError, match="--hidden-size"):
        _check_compatible({**state, "args": {"model": {**state["args"]["model"], "hidden_size": 32}}}, config, "ckpt",
                          universal=False)
    with pytest.raises(CheckpointError, match="written by Megatron-DeepSpeed .* a SimpleNamespace"):
        _check_compatible({**state, "args": SimpleNamespace(hidden_size=64)}, config, "ckpt", universal=False)
    repadded = {**state, "args": {"model": {**state["args"]["model"], "padded_vocab_size": 128}}}
    with pytest.raises(CheckpointError, match="--padded-vocab-size"):
        _check_compatible(repadded, config, "ckpt", universal=False)
    _check_compatible(repadded, config, "ckpt", universal=True)  # re-padded for the new TP size


def test_rng_states_round_trip():
    model_parallel_seed(5, 0, 0)
    saved = rng_states()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    with get_rng_tracker().fork():
        first_tracked = torch.rand(1).item()
    restore_rng_states(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    with get_rng_tracker().fork():
        assert torch.rand(1).item() == first_tracked
    with pytest.raises(CheckpointError, match="--no-load-rng"):
        restore_rng_states({"iteration": 1})


# ---------------------------------------------------------------------------------------- stops and refusals


def test_exit_label():
    schedule = SimpleNamespace(exit_duration_in_mins=10, exit_interval=None)
    assert exit_label(5, 9.5, schedule) is None
    assert exit_label(5, 10.5, schedule) == "exiting program after 10.5 minutes"
    schedule = SimpleNamespace(exit_duration_in_mins=None, exit_interval=4)
    assert exit_label(3, None, schedule) is None
    assert exit_label(8, None, schedule) == "exiting program at iteration 8"


def test_select_accelerator_sets_cpu_without_cuda(monkeypatch):
    from megatron.training.initialize import ACCELERATOR_ENV, select_accelerator

    monkeypatch.delenv(ACCELERATOR_ENV, raising=False)
    assert select_accelerator(cuda_available=False) == "cpu" and os.environ[ACCELERATOR_ENV] == "cpu"
    monkeypatch.setenv(ACCELERATOR_ENV, "cuda")
    assert select_accelerator(cuda_available=False) == "cuda"  # the user's choice stays


def test_the_accelerator_is_chosen_before_anything_imports_deepspeed():
    """Importing the start-up module must not import deepspeed, whose own guess prints a warning on
    every process of a CPU run ("Setting accelerator to CPU")."""
    code = ("import sys; from megatron.training.initialize import select_accelerator; "
            "assert 'deepspeed' not in sys.modules; select_accelerator(); import deepspeed.accelerator as a; "
            "print(a.get_accelerator().device_name())")
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    result = subprocess.run([sys.executable, "-c", code], env={**env, "CUDA_VISIBLE_DEVICES": ""}, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "cpu", result.stderr[-2000:]
    assert "Setting accelerator" not in result.stdout + result.stderr


def test_each_python_environment_builds_its_ops_in_its_own_directory(monkeypatch, tmp_path):
    import sys

    import torch.utils.cpp_extension as cpp_extension
    from megatron.training.initialize import EXTENSIONS_DIR_ENV, use_environment_extensions_dir

    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    monkeypatch.delenv(EXTENSIONS_DIR_ENV, raising=False)
    first = use_environment_extensions_dir()
    assert os.path.dirname(first) == str(tmp_path) and os.environ[EXTENSIONS_DIR_ENV] == first
    assert cpp_extension._get_build_directory("op", verbose=False) == os.path.join(first, "op")
    monkeypatch.delenv(EXTENSIONS_DIR_ENV)
    assert use_environment_extensions_dir() == first  # the same environment finds its builds again
    monkeypatch.delenv(EXTENSIONS_DIR_ENV)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    second = use_environment_extensions_dir()
    assert os.path.dirname(second) == str(tmp_path) and second != first
    monkeypatch.setenv(EXTENSIONS_DIR_ENV, str(tmp_path / "mine"))
    assert use_environment_extensions_dir() == str(tmp_path / "mine")  # the user's choice stays


def test_fused_kernel_constraints_name_each_kernel_that_would_fall_back(monkeypatch):
    from megatron.core.fused_kernels import set_fused_kernels_enabled
    from megatron.training.initialize import (FusedKernelConstraintError, check_fused_kernel_constraints,
                                              fused_kernel_violations)

    fits = GPTModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128, seq_length=64,
                          max_position_embeddings=64, attention_impl="materialized", params_dtype=torch.bfloat16)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if triton were installed
    assert fused_kernel_violations(fits, 1, 2) == []
    too_long = GPTModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128,
                              seq_length=20000, max_position_embeddings=20000, attention_impl="materialized")
    assert fused_kernel_violations(too_long, 1, 1) == ["scale-mask-softmax: sk = 20000 keys > 16384"]
    set_fused_kernels_enabled(False)
    try:
        assert fused_kernel_violations(fits, 1, 2)[0].startswith("fused kernels are disabled")
        with pytest.raises(FusedKernelConstraintError, match="--abort-on-unmet-fused-kernel-constraints"):
            check_fused_kernel_constraints(fits, 1, 2, cuda_available=True)
        check_fused_kernel_constraints(fits, 1, 2, cuda_available=False)  # CPU: references by design
    finally:
        set_fused_kernels_enabled(None)


def test_log_levels_per_rank():
    import logging

    from megatron.training.initialize import apply_log_levels

    settings = SimpleNamespace(log_level="debug", log_level_replica="error")
    try:
        apply_log_levels(settings, global_rank=0)
        assert logging.getLogger("megatron").level == logging.DEBUG
        assert logging.getLogger("DeepSpeed").level == logging.DEBUG
        apply_log_levels(settings, global_rank=3)
        assert logging.getLogger("megatron").level == logging.ERROR
    finally:
        for name in ("megatron", "DeepSpeed", "transformers"):
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_a_checkpoint_of_the_other_engine_is_refused(tmp_path):
    from megatron.training.checkpoint_checks import _check_engine_layout, resume_directory

    (tmp_path / "global_step3").mkdir()
    (tmp_path / "global_step3" / "layer_01-model_00-model_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("global_step3")
    plain_engine = SimpleNamespace(pipeline_layout=False)
    with pytest.raises(CheckpointError, match="written by the pipeline engine .* uses the plain engine"):
        _check_engine_layout(plain_engine, resume_directory(str(tmp_path)))


@pytest.mark.parametrize("content, message", [
    (b"", "latest is empty"), (b"  \n", "latest is empty"), (b"\x80\x81\xff", "is not a tag name"),
    (b"global_step3\x00", "is not a tag name"), (b"global_step3\nglobal_step5", "is not a tag name"),
    (b"global_step3" * 400, "is not a tag name"), (b"global_step9", "global_step9, which is nothing"),
    (b"notes.txt", "notes.txt, which is a file"),
])
def test_a_malformed_latest_is_one_clear_error(tmp_path, content, message):
    from megatron.training.checkpoint_checks import resume_directory
    (tmp_path / "global_step3").mkdir()
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as error:
        resume_directory(str(tmp_path))
    assert str(tmp_path / "latest") in str(error.value)
    (tmp_path / "latest").write_bytes(b"global_step3\n")
    assert resume_directory(str(tmp_path)) == str(tmp_path / "global_step3")


def test_checkpoints_without_latest_are_not_a_fresh_start(tmp_path):
    from megatron.training.checkpoint_checks import resume_directory
    assert resume_directory(str(tmp_path)) is None and resume_directory(str(tmp_path / "absent")) is None
    for iteration in (2, 10, 4):
        (tmp_path / f"global_step{iteration}").mkdir()
    with pytest.raises(CheckpointError, match=r"holds checkpoints \(global_step2, global_step4, global_step10\) "
                                              r"but no 'latest'.*\(e\.g\. global_step10\)"):
        resume_directory(str(tmp_path))


@pytest.mark.parametrize("load, finetune, overwrite, refused", [
    (None, False, False, True), ("absent", False, False, True), ("save", False, False, False),
    ("save", True, False, True), (None, False, True, False), ("save", True, True, False),
])
def test_a_run_from_iteration_0_never_overwrites_saved_checkpoints(tmp_path, load, finetune, overwrite, refused):
    from megatron.training.checkpoint_checks import check_checkpoint_directories
    save = tmp_path / "save"
    (save / "global_step4").mkdir(parents=True)
    (save / "latest").write_text("global_step4")
    settings = CheckpointConfig(save=str(save), load=str(tmp_path / load) if load else None, save_interval=2,
                                no_load_optim=False, no_load_rng=False, no_save_rng=False, finetune=finetune, universal_checkpoint=False,
                                overwrite_checkpoints=overwrite, save_interval_ranges=(), keep_last_checkpoints=None,
                                pinned_checkpoints=())
    if not refused:
        check_checkpoint_directories(settings)
        return
    with pytest.raises(CheckpointError, match=r"--save .* already holds checkpoints \(global_step4\).*"
                                              r"--overwrite-checkpoints"):
        check_checkpoint_directories(settings)


@pytest.mark.parametrize("loss, skipped, grad_norm, fp16, nan", [
    (2.0, False, 1.0, False, False), (float("nan"), True, float("nan"), False, True),
    (2.0, True, float("inf"), False, True), (2.0, True, float("inf"), True, False),
    (float("inf"), True, float("inf"), True, True), (None, True, None, False, False),
    (2.0, True, None, False, False),
])
def test_a_nan_iteration_is_a_skipped_one_with_a_non_finite_loss_or_gradient(loss, skipped, grad_norm, fp16, nan):
    from megatron.training.training import StepResult
    assert StepResult(loss, skipped, grad_norm).is_nan(fp16) is nan
