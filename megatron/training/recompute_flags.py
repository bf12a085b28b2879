"""The model's activation-recompute fields from Megatron-LM's recompute flags and Megatron-DeepSpeed's
(argument_groups.add_recompute_args, --checkpoint-activations, --checkpoint-num-layers): one
derivation shared by the trainer's config and tools/model_calculator.py, which imports no engine."""
from megatron.core.models.gpt.config import RECOMPUTE_MODULES, SELECTIVE_RECOMPUTE_DEFAULT
from megatron.training.argument_types import ArgumentError

# Megatron-LM's selective-recompute modules of layers this trainer does not build
_FOREIGN_RECOMPUTE_MODULES = {**dict.fromkeys(("moe", "moe_act", "shared_experts"), "mixture-of-experts layers"),
                              "mla_up_proj": "multi-latent attention"}


def recompute_settings(flags) -> dict:
    """The model's recompute fields from Megatron-LM's flags and Megatron-DeepSpeed's:
    --checkpoint-activations = --recompute-granularity full (method uniform), --recompute-activations
    = selective, --checkpoint-num-layers = --recompute-num-layers. Selective recompute with
    --recompute-method block --recompute-num-layers N (which Megatron-LM refuses) keeps it to the first
    N layers of each stage. Contradictions raise ArgumentError."""
    granularity = flags.recompute_granularity
    if flags.recompute_activations:
        if granularity == "full":
            raise ArgumentError("--recompute-activations (selective recompute) contradicts "
                                "--recompute-granularity full: keep one")
        granularity = "selective"
    if flags.checkpoint_activations:
        if granularity == "selective":
            chosen = "--recompute-activations" if flags.recompute_activations else "--recompute-granularity selective"
            raise ArgumentError(f"--checkpoint-activations (full recompute) contradicts {chosen}: keep one")
        granularity = "full"
    num_layers = flags.checkpoint_num_layers
    if flags.recompute_num_layers is not None:
        if num_layers not in (1, flags.recompute_num_layers):
            raise ArgumentError(f"--recompute-num-layers {flags.recompute_num_layers} contradicts "
                                f"--checkpoint-num-layers {num_layers} (the same number): give one")
        num_layers = flags.recompute_num_layers
    layer_choice = flags.recompute_method is not None or flags.recompute_num_layers is not None
    if granularity is None and layer_choice:
        raise ArgumentError("--recompute-method and --recompute-num-layers choose the layers of recompute: "
                            "add --recompute-granularity full (or --checkpoint-activations) or selective")
    if granularity == "selective" and layer_choice and (flags.recompute_method != "block"
                                                        or flags.recompute_num_layers is None):
        raise ArgumentError("selective recompute runs in every layer, or with --recompute-method block "
                            "--recompute-num-layers N in the first N layers of each pipeline stage: give both")
    if granularity != "selective" and flags.recompute_modules is not None:
        raise ArgumentError("--recompute-modules chooses what selective recompute recomputes: add "
                            "--recompute-granularity selective (or --recompute-activations)")
    return {"checkpoint_activations": granularity == "full", "checkpoint_num_layers": num_layers,
            "recompute_method": flags.recompute_method or "uniform",
            "recompute_modules": _selective_modules(flags) if granularity == "selective" else ()}


def _selective_modules(flags) -> tuple[str, ...]:
    """--recompute-modules, or the default: the norms' and the MLP activation's outputs (elementwise
    work), and the attention core where it keeps the s x s scores (--deterministic's materialized
    attention; flash/sdpa keeps none, so recomputing it would free next to nothing)."""
    if flags.recompute_modules is None:
        post_layernorm = flags.apply_residual_connection_post_layernorm  # the norms' outputs are residuals
        default = (("core_attn",) if flags.deterministic else ()) + SELECTIVE_RECOMPUTE_DEFAULT
        return tuple(m for m in default if not (post_layernorm and m == "layernorm"))
    for module in flags.recompute_modules:
        if module in _FOREIGN_RECOMPUTE_MODULES:
            raise ArgumentError(f"--recompute-modules {module}: this trainer builds no "
                                f"{_FOREIGN_RECOMPUTE_MODULES[module]}; selective recompute here knows "
                                f"{' '.join(RECOMPUTE_MODULES)}")
    return tuple(dict.fromkeys(flags.recompute_modules))
