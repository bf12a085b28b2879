"""Megatron-DeepSpeed's RNG tracker states (one CUDA generator state per stream) made ours (a CPU and a
CUDA state per stream): on a machine without CUDA the stream keeps its seeded CPU state."""
import torch

from megatron.core.tensor_parallel import get_rng_tracker, model_parallel_seed
from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG
from megatron.training.engine.megatron_deepspeed_resume import own_rng_states


def test_their_tracker_states_become_ours_keeping_the_seeded_cpu_stream():
    model_parallel_seed(7, tp_rank=0, pp_rank=0)
    seeded = get_rng_tracker().get_states()
    cuda_state = torch.zeros(16, dtype=torch.uint8)  # the size of a CUDA generator state
    state = {"random_rng_state": None, "rng_tracker_states": {MODEL_PARALLEL_RNG: cuda_state}}
    own = own_rng_states(state)["rng_tracker_states"]
    assert set(own) == set(seeded)
    assert torch.equal(own[MODEL_PARALLEL_RNG].cpu, seeded[MODEL_PARALLEL_RNG].cpu)
    expected_cuda = cuda_state if torch.cuda.is_available() else seeded[MODEL_PARALLEL_RNG].cuda
    assert own[MODEL_PARALLEL_RNG].cuda is expected_cuda
    get_rng_tracker().set_states(own)  # restorable as it is
    with get_rng_tracker().fork():
        torch.rand(1)
