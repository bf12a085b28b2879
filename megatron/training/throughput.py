"""Throughput of an iteration: Megatron-DeepSpeed's TFLOPs estimate, model TFLOP/s and MFU.

FLOP counts (B = global batch, s = sequence length, L = layers, h = hidden, V = padded vocabulary,
f = ffn hidden size, p = heads x kv channels, g = 2 with a GLU else 1):

- Model FLOPs per iteration: the matmuls of one forward pass per
  token and layer are QKV 6hp, scores 2sp, attention x values 2sp, output projection 2ph,
  MLP 2hf·g + 2fh; the logits add 2hV per token. Training costs three forward passes (backward = 2),
  recomputation earns nothing:
      F = 3·B·s·[L·(8hp + 4sp + 2hf(g + 1)) + 2hV]
  which for p = h, f = 4h, no GLU is 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)).
- Megatron-DeepSpeed's TFLOPs field, the hardware count (it uses V/(16·L·h) and 32 instead of 24 with GLU):
      coef·B·s·L·h²·[(3 + r)·(1 + s/(6h)) + (3 + r_V)·V/(16·L·h)] / (t·world_size·1e12)
  r is the share of the layers' forward matmul FLOPs that recompute runs again (``recomputed_fraction``):
  1 under full recompute, uniform; N·pp / L under block (each of pp stages recomputes its first N
  layers); selective: the recomputed modules' share of a layer (core_attn: the 4sp of attention, mlp:
  the MLP's 2hf(g + 1); layernorm and mlp_act are elementwise, no matmul), times N·pp / L under
  block. r_V = 1 only under full
  uniform recompute, where Megatron-DeepSpeed counts 4 passes of everything (its
  --checkpoint-activations figure, kept for continuity); 0 otherwise.
- model TFLOP/s = F / (t · world_size · 1e12) per GPU; MFU = model TFLOP/s / measured peak TFLOP/s.
"""
from dataclasses import dataclass

from megatron.core.flops import layer_forward_flops_per_token, model_flops_per_iteration
from megatron.core.models.gpt.config import GPTModelConfig


def megatron_deepspeed_tflops(*, global_batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                padded_vocab_size: int, glu: bool, checkpoint_activations: bool, iteration_time: float,
                world_size: int, recomputed_fraction: float | None = None) -> float:
    """Megatron-DeepSpeed's per-GPU TFLOPs estimate (module docstring), for an iteration of ``iteration_time`` s.

    ``checkpoint_activations`` alone is full uniform recompute (r = r_V = 1); ``recomputed_fraction``
    r, when given, is the layers' recomputed share of any other mode (r_V = 0)."""
    coefficient = 32 if glu else 24
    if recomputed_fraction is None:
        layer_passes = vocab_passes = 4 if checkpoint_activations else 3
    else:
        layer_passes, vocab_passes = 3 + recomputed_fraction, 3
    b, s, n, h, v = global_batch_size, seq_length, num_layers, hidden_size, padded_vocab_size
    flops = coefficient * b * s * n * h ** 2 * (layer_passes * (1.0 + s / (6.0 * h))
                                                + vocab_passes * v / (16.0 * n * h))
    return flops / (iteration_time * world_size * 1e12)


def recomputed_fraction(config: GPTModelConfig, pipeline_model_parallel_size: int = 1) -> float:
    """r of the module docstring: the share of the transformer layers' forward matmul FLOPs run again."""
    if config.checkpoint_activations:
        return 1.0 if config.recompute_method == "uniform" else _block_share(config, pipeline_model_parallel_size)
    if not config.recompute_modules:
        return 0.0
    glu = config.glu_activation is not None
    layer = layer_forward_flops_per_token(config.hidden_size, config.seq_length, config.ffn_hidden_size,
                                          config.projection_size, glu, config.key_value_size)
    recomputed = 0
    if "core_attn" in config.recompute_modules:
        recomputed += 4 * config.seq_length * config.projection_size
    if "mlp" in config.recompute_modules:
        recomputed += 2 * config.hidden_size * config.ffn_hidden_size * (3 if glu else 2)
    layers = _block_share(config, pipeline_model_parallel_size) if config.recompute_method == "block" else 1.0
    return recomputed / layer * layers


def _block_share(config: GPTModelConfig, pipeline_model_parallel_size: int) -> float:
    """N p / L: the share of the layers that --recompute-method block recomputes in, the first N of each stage."""
    return min(config.checkpoint_num_layers * pipeline_model_parallel_size, config.num_layers) / config.num_layers


def model_flops(config: GPTModelConfig, global_batch_size: int, seq_length: int) -> float:
    """model_flops_per_iteration of this model for one iteration of ``global_batch_size`` sequences."""
    return model_flops_per_iteration(global_batch_size=global_batch_size, seq_length=seq_length,
                                     num_layers=config.num_layers, hidden_size=config.hidden_size,
                                     padded_vocab_size=config.padded_vocab_size,
                                     ffn_hidden_size=config.ffn_hidden_size, projection_size=config.projection_size,
                                     glu=config.glu_activation is not None, key_value_size=config.key_value_size)


def model_tflops_and_mfu(flops_per_iteration: float, iteration_time: float, world_size: int,
                         peak_tflops: float | None) -> tuple[float, float | None]:
    """(model TFLOP/s per GPU, MFU as a fraction or None without a measured peak)."""
    tflops = flops_per_iteration / (iteration_time * world_size * 1e12)
    return tflops, (tflops / peak_tflops if peak_tflops else None)


@dataclass(frozen=True)
class Throughput:
    """Rates of one iteration; per replica divides by the data-parallel size, TFLOP figures are per GPU."""

    iteration_time: float
    samples_per_second: float
    samples_per_second_per_replica: float
    tokens_per_second: float
    tokens_per_second_per_replica: float
    tflops: float
    model_tflops: float
    mfu: float | None


def compute_throughput(config: GPTModelConfig, *, global_batch_size: int, seq_length: int,
                       iteration_time: float, world_size: int, data_parallel_size: int,
                       peak_tflops: float | None = None, pipeline_model_parallel_size: int = 1) -> Throughput:
    """Throughput of an iteration of ``global_batch_size`` sequences of ``seq_length`` tokens.

    ``seq_length`` is the curriculum length when curriculum learning truncates the batch.
    ``pipeline_model_parallel_size`` counts the stages that each recompute their first N layers
    under --recompute-method block.
    """
    samples_per_second = global_batch_size / iteration_time
    glu = config.glu_activation is not None
    uniform = config.checkpoint_activations and config.recompute_method == "uniform"
    tflops = megatron_deepspeed_tflops(global_batch_size=global_batch_size, seq_length=seq_length,
                         num_layers=config.num_layers, hidden_size=config.hidden_size,
                         padded_vocab_size=config.padded_vocab_size, glu=glu,
                         checkpoint_activations=uniform, iteration_time=iteration_time, world_size=world_size,
                         recomputed_fraction=None if uniform else recomputed_fraction(
                             config, pipeline_model_parallel_size))
    flops = model_flops(config, global_batch_size, seq_length)
    model_tflops, mfu = model_tflops_and_mfu(flops, iteration_time, world_size, peak_tflops)
    return Throughput(iteration_time=iteration_time, samples_per_second=samples_per_second,
                      samples_per_second_per_replica=samples_per_second / data_parallel_size,
                      tokens_per_second=samples_per_second * seq_length,
                      tokens_per_second_per_replica=samples_per_second * seq_length / data_parallel_size,
                      tflops=tflops, model_tflops=model_tflops, mfu=mfu)


def gigaflos_no_embeddings(new_samples: int, seq_length: int, parameters_without_embeddings_billions: float) -> float:
    """Megatron-DeepSpeed's increment of its "gigaflos (without embeddings)" x-axis: 6 · samples · s · params(B)."""
    return 6.0 * new_samples * seq_length * parameters_without_embeddings_billions
