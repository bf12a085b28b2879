"""launch_env: rank, world size, local rank and rendezvous as each launcher leaves them (fake envs)."""
import socket

import pytest

from megatron.training.launch_env import (DEFAULT_MASTER_PORT, LaunchEnv, LaunchEnvError, effective_backend,
                                          first_host, read_launch_env, threads_per_process)

TORCH_VARS = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


def test_single_process_without_variables_gets_a_free_port():
    launch = read_launch_env({})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.source) == \
        (0, 1, 0, "127.0.0.1", "single")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", launch.master_port))  # nothing listens there
    assert read_launch_env({"MASTER_PORT": "6123"}).master_port == 6123


def test_rank_0_without_world_size_is_a_world_of_one():
    launch = read_launch_env({"RANK": "0", "LOCAL_RANK": "0"})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.source) == (0, 1, 0, "env")
    with pytest.raises(LaunchEnvError, match="RANK=3 is set but WORLD_SIZE is not"):
        read_launch_env({"RANK": "3"})


def test_several_processes_without_master_port_meet_on_megatrons_default():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "node01"}
    assert read_launch_env(env).master_port == DEFAULT_MASTER_PORT


def test_deepspeed_launcher_env_and_argv_local_rank():
    env = {**TORCH_VARS, "CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "4"}
    launch = read_launch_env(env, argv_local_rank=1)
    assert launch == LaunchEnv(5, 8, 1, "node01", 29500, "deepspeed")


def test_torchrun():
    launch = read_launch_env({**TORCH_VARS, "TORCHELASTIC_RUN_ID": "abc", "LOCAL_WORLD_SIZE": "4"})
    assert launch == LaunchEnv(5, 8, 1, "node01", 29500, "torchrun")


@pytest.mark.parametrize("with_env_local_rank", [True, False])
def test_torch_distributed_launch_passes_local_rank_on_argv(with_env_local_rank):
    env = dict(TORCH_VARS)
    if not with_env_local_rank:  # torch < 1.9 without --use_env: only argv carries it
        del env["LOCAL_RANK"]
    launch = read_launch_env(env, argv_local_rank=1)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.source) == (5, 8, 1, "torch.distributed.launch")


def test_plain_environment():
    assert read_launch_env(TORCH_VARS) == LaunchEnv(5, 8, 1, "node01", 29500, "env")


def test_slurm_srun_with_nodelist_for_master():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "16", "SLURM_LOCALID": "2",
           "SLURM_JOB_NODELIST": "node[01-04],gpu7"}
    assert read_launch_env(env) == LaunchEnv(6, 16, 2, "node01", DEFAULT_MASTER_PORT, "slurm")


def test_slurm_master_addr_and_port_from_env_win():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node[01-02]",
           "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "7001"}
    launch = read_launch_env(env)
    assert (launch.master_addr, launch.master_port) == ("10.0.0.9", 7001)


def test_torchrun_inside_srun_reads_torchrun_ranks():
    env = {**TORCH_VARS, "TORCHELASTIC_RUN_ID": "x", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.source) == (5, 8, "torchrun")


@pytest.mark.parametrize("nodelist, host", [
    ("node[01-04],gpu7", "node01"), ("gpu7", "gpu7"), ("gpu7,node[1-2]", "gpu7"),
    ("r[2-3]n[05,07]", "r2n05"), ("rack1-node[10,12-14]-ib", "rack1-node10-ib"), (" jean-zay-iam[01-02] ", "jean-zay-iam01"),
])
def test_first_host_of_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_bad_nodelist_is_an_error():
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):
        first_host("node[01-04")


@pytest.mark.parametrize("env, argv_local_rank, words", [
    ({"RANK": "2"}, None, ["WORLD_SIZE"]),
    ({"WORLD_SIZE": "2"}, None, ["RANK"]),
    ({**TORCH_VARS, "RANK": "x"}, None, ["RANK", "not an integer"]),
    ({**TORCH_VARS, "RANK": "8"}, None, ["RANK=8", "WORLD_SIZE=8"]),
    ({**TORCH_VARS, "LOCAL_RANK": "2"}, 1, ["--local_rank=1", "LOCAL_RANK=2"]),
    ({k: v for k, v in TORCH_VARS.items() if k != "LOCAL_RANK"}, None, ["LOCAL_RANK"]),
    ({k: v for k, v in TORCH_VARS.items() if k != "MASTER_ADDR"}, None, ["MASTER_ADDR"]),
    ({**TORCH_VARS, "MASTER_PORT": "70000"}, None, ["MASTER_PORT"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, None, ["MASTER_ADDR"]),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "MASTER_ADDR": "h"}, None, ["SLURM_PROCID"]),
])
def test_inconsistent_launch_variables_are_named(env, argv_local_rank, words):
    with pytest.raises(LaunchEnvError) as info:
        read_launch_env(env, argv_local_rank)
    for word in words:
        assert word in str(info.value)


def test_torch_env_round_trip():
    launch = LaunchEnv(3, 4, 1, "h", 1234, "env")
    assert read_launch_env(launch.torch_env()) == launch


@pytest.mark.parametrize("requested, cuda, backend, has_notice", [
    ("nccl", True, "nccl", False), ("nccl", False, "gloo", True), ("gloo", True, "gloo", False),
    ("gloo", False, "gloo", False),
])
def test_effective_backend(requested, cuda, backend, has_notice):
    chosen, notice = effective_backend(requested, cuda)
    assert chosen == backend and (notice is not None) == has_notice
    if has_notice:
        assert "nccl" in notice and "gloo" in notice and "\n" not in notice


def test_processes_of_a_node_share_its_cpus_unless_the_user_chose():
    assert threads_per_process({"LOCAL_SIZE": "2"}, 2) == (1, 2)  # the deepspeed launcher, 2 ranks on 2 cores
    assert threads_per_process({"LOCAL_WORLD_SIZE": "8", "LOCAL_SIZE": "2"}, 64) == (8, 8)
    assert threads_per_process({"LOCAL_SIZE": "4", "OMP_NUM_THREADS": ""}, 2) == (1, 4)  # never below one
    assert threads_per_process({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, 16) is None  # the user's choice
    assert threads_per_process({"LOCAL_SIZE": "1"}, 16) is None and threads_per_process({}, 16) is None
