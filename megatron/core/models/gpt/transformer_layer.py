"""The pre-LN transformer layer."""
import torch
from torch import nn

from megatron.core import fused_kernels
from megatron.core.models.gpt.attention import ParallelSelfAttention
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.layer_norm import LayerNorm, RMSNorm, build_norm
from megatron.core.models.gpt.mlp import ParallelMLP
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG, CheckpointWithoutOutput, get_rng_tracker


class ParallelTransformerLayer(nn.Module):
    """One pre-LN decoder layer on [s, b, h] (LN: --normalization, LayerNorm or RMSNorm):

        a = LN_1(x);  x' = r_1 + dropout(Attn(a))  with r_1 = x (or a with --apply-residual-connection-post-layernorm)
        m = LN_2(x'); y  = r_2 + dropout(MLP(m))   with r_2 = x' (or m)

    Dropout (--hidden-dropout) and the residual add are fused with the projections' biases. With
    --fp32-residual-connection the residual stream x, x', y is fp32 while the LayerNorm outputs
    (the inputs of the matmuls) are in the params dtype. ``layer_number`` is global and 1-based;
    it drives query-key layer scaling and the layout-independent init. With sequence parallelism
    x is this rank's [s / tp, b, h] block; the norms, dropouts and adds run on it, the dropouts
    under the model-parallel RNG stream (each rank holds other positions, so other masks).
    Selective recompute "layernorm" (``recompute_modules``) keeps no copy of LN_1's and LN_2's
    outputs: the projections' backward recomputes them from x and x'. ``recompute_modules`` is the
    config's, or none in a layer that ``limit_selective_recompute`` leaves out.
    """

    def __init__(self, config: GPTModelConfig, layer_number: int, groups: ParallelGroups, device=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.recompute_modules = config.recompute_modules
        self.input_layernorm = build_norm(config, device)
        self.self_attention = ParallelSelfAttention(config, layer_number, groups, device=device)
        self.post_attention_layernorm = build_norm(config, device)
        self.mlp = ParallelMLP(config, layer_number, groups, device=device)
        self.residual_dtype = torch.float32 if config.fp32_residual_connection else config.params_dtype

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [s, b, h], position_ids [b, s], attention_mask bool [b, 1, s, s] or None -> [s, b, h]."""
        recompute = CheckpointWithoutOutput()  # of selective recompute's "layernorm"; unused otherwise
        normed, residual = self.norm_and_residual(self.input_layernorm, hidden_states, recompute)
        with recompute.consumers():
            attention_output, attention_bias = self.self_attention(normed, position_ids, attention_mask)
        return self.mlp_block(self.bias_dropout_add(attention_output, attention_bias, residual))

    def mlp_block(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's second half: x' [s, b, h] -> y = r_2 + dropout(MLP(LN_2(x')))."""
        recompute = CheckpointWithoutOutput()
        normed, residual = self.norm_and_residual(self.post_attention_layernorm, hidden_states, recompute)
        with recompute.consumers():
            mlp_output, mlp_bias = self.mlp(normed)
        return self.bias_dropout_add(mlp_output, mlp_bias, residual)

    def norm_and_residual(self, norm: LayerNorm | RMSNorm, x: torch.Tensor,
                          recompute: CheckpointWithoutOutput | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x) in the params dtype, the residual branch: norm(x) or x). Under selective recompute
        "layernorm" the norm runs through ``recompute``, whose ``consumers()`` then keep no copy of
        its output (pre-LN only: the output must not be the residual)."""
        if recompute is not None and "layernorm" in self.recompute_modules:
            return recompute.checkpoint(lambda x_: norm(x_).to(self.config.params_dtype), x), x
        if self.config.apply_residual_connection_post_layernorm:
            normed = norm(x).to(self.config.params_dtype)
            return normed, normed
        normed, residual = norm.norm_and_input(x)
        return normed.to(self.config.params_dtype), residual

    def bias_dropout_add(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x + bias) in the residual dtype (bias None: no bias)."""
        dtype = self.residual_dtype
        add = fused_kernels.bias_dropout_add if self.config.bias_dropout_fusion \
            else fused_kernels.bias_dropout_add_reference
        bias = None if bias is None else bias.to(dtype)
        arguments = (x.to(dtype), bias, residual.to(dtype), self.config.hidden_dropout, self.training)
        if self.config.sequence_parallel and self.training and self.config.hidden_dropout > 0.0:
            with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
                return add(*arguments)
        return add(*arguments)

    def without_selective_recompute(self) -> None:
        """This layer keeps all its activations, whatever the config's selective recompute."""
        self.recompute_modules = self.self_attention.recompute_modules = self.mlp.recompute_modules = ()


def limit_selective_recompute(stage_layers: list[ParallelTransformerLayer], config: GPTModelConfig) -> None:
    """Selective recompute with --recompute-method block: its modules in the first N
    (--recompute-num-layers) layers of the stage only; the others keep their activations."""
    if config.recompute_modules and config.recompute_method == "block":
        for layer in stage_layers[config.checkpoint_num_layers:]:
            layer.without_selective_recompute()
