"""Weight initialisation: Megatron-DeepSpeed's normal init, and a draw that does not depend on the parallel layout.

Megatron-DeepSpeed's rule: every weight matrix ~ N(0, sigma^2) with sigma = --init-method-std, except the
output projections of each layer (attention ``dense`` and MLP ``dense_4h_to_h``), which use
sigma / sqrt(2 L) so the residual stream's variance does not grow with depth. Biases are zero,
LayerNorm weights one.

Layout independence (``use_cpu_initialization``): the tensor-parallel layers build each FULL weight
on CPU in fp32, call the init method on it and keep their own slice. Our init method draws from a
fresh ``torch.Generator`` seeded by (seed, layer number, parameter name), so a weight is the same
whatever the TP degree (same full tensor, then sliced) and whatever the PP split (the layer number
is global). Layer number 0 is the embedding, 1..L the transformer layers.
Without it, init methods draw from the current generator (the model-parallel RNG fork for split
weights, as in Megatron's GPU path), so the result depends on the layout.
"""
import hashlib
import math
from collections.abc import Callable

import torch

from megatron.core.models.gpt.config import GPTModelConfig

InitMethod = Callable[[torch.Tensor], None]


def init_method_normal(sigma: float) -> InitMethod:
    """Fill a tensor in place with N(0, sigma^2) from the current default generator."""

    def init_(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            tensor.normal_(0.0, sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """N(0, (sigma / sqrt(2 num_layers))^2): the init of the layers' output projections."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def parameter_seed(seed: int, layer_number: int, param_name: str) -> int:
    """A 63-bit seed that depends only on (seed, layer number, parameter name), stable across processes."""
    digest = hashlib.sha256(f"{seed}/{layer_number}/{param_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seeded_init_method(draw: Callable[[torch.Tensor, torch.Generator], None], seed: int, layer_number: int,
                       param_name: str) -> InitMethod:
    """``draw(tensor, generator)`` from a generator seeded by ``parameter_seed``: the same tensor on every call.

    The draw happens on CPU in fp32 and is copied into the tensor (any device, any dtype); the TP
    layers' ``use_cpu_initialization`` path calls it on the full master weight.
    """

    def init_(tensor: torch.Tensor) -> None:
        generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, layer_number, param_name))
        values = torch.empty(tensor.shape, dtype=torch.float32)
        draw(values, generator)
        with torch.no_grad():
            tensor.copy_(values)

    return init_


def seeded_init_method_normal(sigma: float, seed: int, layer_number: int, param_name: str) -> InitMethod:
    """N(0, sigma^2) through ``seeded_init_method``."""
    return seeded_init_method(lambda values, generator: values.normal_(0.0, sigma, generator=generator),
                              seed, layer_number, param_name)


def stable_embedding_init_method(config: GPTModelConfig, layer_number: int, param_name: str) -> InitMethod:
    """bitsandbytes' StableEmbedding init: U(-a, a) with a = sqrt(6 / (V + h)) (Xavier uniform), where V and
    h are the FULL table's rows and columns whatever slice a TP rank initialises; layout-independent under
    CPU init, as ``weight_init_method``."""
    bound = math.sqrt(6.0 / (config.padded_vocab_size + config.hidden_size))
    if config.use_cpu_initialization:
        return seeded_init_method(lambda values, generator: values.uniform_(-bound, bound, generator=generator),
                                  config.seed, layer_number, param_name)

    def init_(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            tensor.uniform_(-bound, bound)

    return init_


def weight_init_method(config: GPTModelConfig, layer_number: int, param_name: str,
                       output_projection: bool = False) -> InitMethod:
    """The init method of one weight: sigma or sigma / sqrt(2 L), layout-independent under CPU init."""
    sigma = config.init_method_std
    if output_projection:
        sigma /= math.sqrt(2.0 * config.num_layers)
    if config.use_cpu_initialization:
        return seeded_init_method_normal(sigma, config.seed, layer_number, param_name)
    return init_method_normal(sigma)


def initialize_replicated_weight(weight: torch.Tensor, init_method: InitMethod, use_cpu_initialization: bool) -> None:
    """Initialise a weight that every TP rank holds whole (e.g. the learned position table).

    Under CPU initialisation the full fp32 tensor is drawn on CPU and copied in (any device or
    dtype); otherwise the init method runs on the weight itself, from the default generator, which
    is seeded alike on all TP ranks.
    """
    if not use_cpu_initialization:
        init_method(weight)
        return
    master = torch.empty(weight.shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        weight.copy_(master)
