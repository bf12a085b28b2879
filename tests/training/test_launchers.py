"""pretrain_gpt.py under every way of starting it, on CPU: each run trains a few iterations and prints
Megatron-DeepSpeed's log line, and the trainer names the launcher it detected.

    launcher                                   test
    python, MASTER_*/RANK/... in the env       examples/pretrain_gpt_single_gpu.sh, scaled down
    deepspeed --num_gpus 2 (--local_rank=i)    examples/pretrain_gpt_deepspeed_single_node.sh (the single-node
                                               example of Megatron-DeepSpeed), bf16 in place of fp16 (and
                                               unmodified, fp16, on a GPU machine: marked gpu)
    torchrun --nproc_per_node 2                ZeRO-2 through examples/ds_config_zero2.json
    python -m torch.distributed.launch         passes --local-rank=i (torch >= 2.0)
    srun, one task per process                 SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_JOB_NODELIST
    srun + torchrun, c10d rendezvous           examples/pretrain_gpt_slurm.slurm with stand-ins for srun and
                                               scontrol that start one "node" per SLURM_PROCID on this host
    torchrun --nnodes 2 --node_rank i          examples/pretrain_gpt_multinode_torchrun.sh twice on this host
    torchrun, 2 processes                      examples/quickstart.sh, the README's main job, 4 iterations

What stays untested here (examples/README.md): the deepspeed launcher across hosts (pdsh over ssh with a
hostfile), real SLURM allocations, and NCCL; the GPU machine runs the fp16 variants.
"""
import json
import math
import os
import re
import stat
import sys

import pytest

from megatron.training.arguments import parse_args
from tests.dist_utils import free_port
from tests.training.e2e_utils import (EXAMPLES_DIR, PRETRAIN_SCRIPT, ProcessSpec, executable, parse_log_lines,
                                      run_command, run_together, tiny_gpt_flags, torchrun_command)

SHORT_RUN = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
             "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1"]


def data_env(data, output_dir):
    """Environment of the example scripts: the session's corpus and an output directory."""
    return {"DATA_PATH": data.data_prefix, "VOCAB_FILE": data.vocab_file, "MERGE_FILE": data.merge_file,
            "OUTPUT_DIR": str(output_dir)}


def assert_trained(output, launcher, world_size, iterations):
    """The trainer saw ``world_size`` processes from ``launcher`` and logged iterations 1..iterations once each."""
    assert f"world size {world_size} (launcher: {launcher})" in output, output[-3000:]
    lines = parse_log_lines(output)
    assert [line.iteration for line in lines] == iterations, output[-3000:]
    assert all(math.isfinite(line.number("lm loss")) for line in lines)
    return lines


def test_ds_config_templates_are_accepted(e2e_data):
    """Each template passes the ds_config checks with flags it suits (fp16 needs CUDA: validated as on a GPU)."""
    base = tiny_gpt_flags(e2e_data) + SHORT_RUN + ["--deepspeed"]
    cases = {"ds_config_fp16.json": (["--fp16"], True, 1), "ds_config_bf16.json": (["--bf16"], False, 1),
             "ds_config_zero2.json": ([], False, 2)}
    for name, (flags, cuda, stage) in cases.items():
        path = os.path.join(EXAMPLES_DIR, name)
        config = parse_args(base + flags + ["--deepspeed_config", path], env={}, cuda_available=cuda).derived.ds_config
        assert config["train_batch_size"] == 4 and config["train_micro_batch_size_per_gpu"] == 1, name
        assert config["zero_optimization"]["stage"] == stage, name
        assert config["fp16"]["enabled"] is ("--fp16" in flags) and config["bf16"]["enabled"] is ("--bf16" in flags)
        with open(path) as f:
            assert json.load(f)["gradient_clipping"] == 1.0


@pytest.mark.slow
def test_single_process_with_launcher_variables_in_the_environment(e2e_data, tmp_path):
    env = dict(data_env(e2e_data, tmp_path), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1", NLAYERS="2", NHIDDEN="64", NHEADS="4", SEQ_LEN="64",
               MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE="4", TRAIN_ITERS="3", LR_DECAY_ITERS="3", LOG_INTERVAL="1",
               EVAL_INTERVAL="100", EVAL_ITERS="1", SAVE_INTERVAL="3")
    result = run_command(["bash", os.path.join(EXAMPLES_DIR, "pretrain_gpt_single_gpu.sh")], env=env)
    result.assert_ok()
    assert "precision: bf16 (examples/ds_config_bf16.json)" in result.output
    assert_trained(result.output, "env", 1, [1, 2, 3])
    assert "successfully saved checkpoint at iteration       3" in result.output


def run_single_node_example(data, output_dir, cpu_only, processes):
    """examples/pretrain_gpt_deepspeed_single_node.sh with the session's corpus, ``deepspeed`` on the PATH."""
    deepspeed_dir = os.path.dirname(executable("deepspeed"))
    env = dict(data_env(data, output_dir), MASTER_PORT=str(free_port()), N_GPUS=str(processes),
               PATH=os.pathsep.join([deepspeed_dir, os.environ["PATH"]]))
    result = run_command(["bash", os.path.join(EXAMPLES_DIR, "pretrain_gpt_deepspeed_single_node.sh")], env=env,
                         timeout=300, cpu_only=cpu_only)
    result.assert_ok()
    # --train-samples 100 at the ramp's first batch of 2 (the next step is 1000/7 samples away): 50 iterations.
    lines = assert_trained(result.output, "deepspeed", processes, [10, 20, 30, 40, 50])
    assert [int(line.number("consumed samples")) for line in lines] == [20, 40, 60, 80, 100]
    assert {int(line.number("global batch size")) for line in lines} == {2}
    assert "successfully saved checkpoint at iteration      50" in result.output
    assert os.listdir(os.path.join(output_dir, "tensorboard"))
    return result, lines


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_launcher_runs_megatron_deepspeeds_single_node_example(e2e_data, tmp_path):
    result, _ = run_single_node_example(e2e_data, tmp_path, cpu_only=True, processes=2)
    assert "precision: bf16" in result.output
    assert "'--local_rank=1'" in result.output  # DeepSpeed's launcher passes the underscored spelling
    assert "--distributed-backend nccl: no CUDA device here, using gloo" in result.output


@pytest.mark.gpu
@pytest.mark.slow
def test_deepspeed_launcher_runs_megatron_deepspeeds_single_node_example_unmodified_on_gpu(e2e_data, tmp_path):
    """On a GPU the example keeps Megatron-DeepSpeed's fp16 with dynamic loss scaling (initial scale 2^12)."""
    import torch

    result, lines = run_single_node_example(e2e_data, tmp_path, cpu_only=False,
                                            processes=min(2, torch.cuda.device_count()))
    assert "precision: fp16" in result.output
    assert all(0 < line.number("loss scale") <= 4096 for line in lines)


@pytest.mark.distributed
def test_torchrun_with_the_zero2_template(e2e_data, tmp_path):
    flags = tiny_gpt_flags(e2e_data) + SHORT_RUN + [
        "--deepspeed", "--deepspeed_config", os.path.join(EXAMPLES_DIR, "ds_config_zero2.json")]
    result = run_command(torchrun_command(2) + [PRETRAIN_SCRIPT, *flags])
    result.assert_ok()
    assert_trained(result.output, "torchrun", 2, [1, 2, 3])


@pytest.mark.distributed
def test_torch_distributed_launch_passes_local_rank_dashed(e2e_data):
    command = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), PRETRAIN_SCRIPT,
               *tiny_gpt_flags(e2e_data), *SHORT_RUN, "--tensor-model-parallel-size", "2"]
    result = run_command(command)
    result.assert_ok()
    assert_trained(result.output, "torch.distributed.launch", 2, [1, 2, 3])


@pytest.mark.distributed
def test_srun_tasks_read_rank_and_world_from_slurm_variables(e2e_data):
    """One srun task per process: no RANK/WORLD_SIZE, the rendezvous host is the nodelist's first host."""
    port = str(free_port())
    command = [sys.executable, PRETRAIN_SCRIPT, *tiny_gpt_flags(e2e_data), *SHORT_RUN,
               "--pipeline-model-parallel-size", "2"]
    specs = [ProcessSpec(command, {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                                   "SLURM_JOB_NODELIST": "localhost,node[2-3]", "MASTER_PORT": port})
             for rank in range(2)]
    results = run_together(specs)
    for result in results:
        result.assert_ok()
    assert_trained(results[0].output + results[1].output, "slurm", 2, [1, 2, 3])


FAKE_SRUN = """#!/bin/bash
# Stand-in for srun on one host: the command once per node of the allocation, as SLURM_PROCID 0..N-1.
while [ $# -gt 0 ]; do
    case $1 in
        --jobid|--nodes|--ntasks) shift 2 ;;
        --*) shift ;;
        *) break ;;
    esac
done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_PROCID=$node SLURM_NODEID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
# Stand-in for `scontrol show hostnames LIST`: every node of the test allocation is this host.
for ((node = 0; node < SLURM_NNODES; node++)); do echo localhost; done
"""


def write_executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_script_srun_torchrun_c10d(e2e_data, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_executable(bin_dir / "srun", FAKE_SRUN)
    write_executable(bin_dir / "scontrol", FAKE_SCONTROL)
    torchrun_dir = os.path.dirname(executable("torchrun"))
    output_dir = tmp_path / "job"
    env = {"PATH": os.pathsep.join([str(bin_dir), torchrun_dir, os.environ["PATH"]]), "SLURM_JOB_ID": "4242",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost", "GPUS_PER_NODE": "1", "PRECISION": "bf16",
           "MASTER_PORT": str(free_port()), "REPO_DIR": os.path.dirname(EXAMPLES_DIR),
           "DATA_PATH": e2e_data.data_prefix, "VOCAB_FILE": e2e_data.vocab_file, "MERGE_FILE": e2e_data.merge_file,
           "DATA_OUTPUT_PATH": str(output_dir)}
    result = run_command(["bash", os.path.join(EXAMPLES_DIR, "pretrain_gpt_slurm.slurm")], env=env, timeout=300)
    result.assert_ok()
    # Rampup 4 4 32 to 16 over --train-samples 96: batches 4 4 4 8 8 12 16 16 16, i.e. 9 iterations.
    lines = assert_trained(result.output, "torchrun", 2, list(range(1, 10)))
    assert [int(line.number("global batch size")) for line in lines] == [4, 4, 4, 8, 8, 12, 16, 16, 16]
    with open(output_dir / "logs" / "main_log.txt") as f:
        assert len(parse_log_lines(f.read())) == 9
    assert (output_dir / "checkpoints" / "latest").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_through_torchrun_static_rendezvous(e2e_data, tmp_path):
    executable("torchrun")
    port = str(free_port())
    script = ["bash", os.path.join(EXAMPLES_DIR, "pretrain_gpt_multinode_torchrun.sh")]
    sizes = {"NNODES": "2", "GPUS_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "TP_SIZE": "1", "PP_SIZE": "2", "NLAYERS": "2", "NHIDDEN": "64", "NHEADS": "4", "SEQ_LEN": "64",
             "MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "4", "TRAIN_SAMPLES": "12", "LR_WARMUP_SAMPLES": "4",
             "LOG_INTERVAL": "1", "EVAL_INTERVAL": "100", "EVAL_ITERS": "1"}
    specs = [ProcessSpec(script, dict(data_env(e2e_data, tmp_path), NODE_RANK=str(node), **sizes))
             for node in range(2)]
    results = run_together(specs)
    for result in results:
        result.assert_ok()
    assert_trained(results[0].output + results[1].output, "torchrun", 2, [1, 2, 3])
    # bf16 from ds_config_bf16.json, whose fp32 gradient accumulation is the template's (no notice adds it).
    assert re.search(r"^  bf16 \.+ True$", results[0].output, re.MULTILINE)
    assert "'data_types': {'grad_accum_dtype': 'fp32'}" in results[0].output
    assert "notice: bf16: gradients accumulate in fp32" not in results[0].output


@pytest.mark.slow
@pytest.mark.distributed
def test_quickstart_main_job_end_to_end(tmp_path):
    """The README's main job, shortened to 4 iterations: tokenizer, preprocessing, 2-process pretraining
    on CPU with the final evaluation, a checkpoint and TensorBoard, and the summary of where things are.
    Run again, it resumes at iteration 4 (nothing left to train, nothing saved again) and keeps the
    first run's log beside its own."""
    run_dir = tmp_path / "quickstart"
    env = {"SKIP_INSTALL": "1", "RUN_DIR": str(run_dir), "TRAIN_ITERS": "4", "MASTER_PORT": str(free_port()),
           "PYTHON": sys.executable}
    result = run_command(["bash", os.path.join(EXAMPLES_DIR, "quickstart.sh")], env=env, timeout=600)
    result.assert_ok()
    assert "on 2 CPU processes, fp32" in result.output and "notice: --distributed-backend" not in result.output
    assert_trained(result.output, "torchrun", 2, [])  # --log-interval 10: no line in 4 iterations
    val = "validation loss at the end of training for val data"
    test = "validation loss at the end of training for test data"
    assert [prefix for prefix, _, _ in result.validation_losses()] == [val, test]
    summary = [line for line in result.output.splitlines() if "training summary |" in line]
    assert len(summary) == 6 and "iterations: 4 (4 in this run)" in summary[0]  # printed, then repeated at the end
    for path in ("tokenizer/vocab.json", "tokenizer/merges.txt", "data/python-docs_text_document.bin",
                 "data/python-docs_text_document.idx"):
        assert (run_dir / path).exists(), path
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step4"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir / "tensorboard"))
    assert f"checkpoints   {run_dir}/checkpoints (latest: global_step4)" in result.output
    first_log = [name for name in os.listdir(run_dir / "logs") if name.startswith("pretrain_")]
    assert len(first_log) == 1 and "training summary" in (run_dir / "logs" / first_log[0]).read_text()

    saved = os.path.getmtime(run_dir / "checkpoints" / "global_step4")
    again = run_command(["bash", os.path.join(EXAMPLES_DIR, "quickstart.sh")],
                        env={**env, "MASTER_PORT": str(free_port())}, timeout=600)
    again.assert_ok()
    assert "successfully loaded checkpoint" in again.output and "iterations: 4 (0 in this run)" in again.output
    assert "saving checkpoint" not in again.output  # iteration 4 is on disk: latest's files are not rewritten
    assert os.path.getmtime(run_dir / "checkpoints" / "global_step4") == saved
    logs = sorted(name for name in os.listdir(run_dir / "logs") if name.startswith("pretrain_"))
    assert len(logs) == 2 and first_log[0] in logs
    assert "iterations: 4 (4 in this run)" in (run_dir / "logs" / first_log[0]).read_text()
