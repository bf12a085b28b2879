"""8-bit AdamW from bitsandbytes (--use-bnb-optimizer), with 32-bit state for the word embedding.

bitsandbytes' AdamW8bit keeps Adam's two moments as 8-bit codes, block-wise quantized (2 bytes per
parameter instead of 8), and applies the same decoupled-weight-decay update as torch's AdamW. The
BigScience 104B runs paired it with bitsandbytes' StableEmbedding: a LayerNorm after the word
embedding and Xavier-uniform init (the model's ``stable_embedding``), and 32-bit optimizer state for
the embedding table, whose rare tokens' moments 8-bit codes represent poorly. Here the table is a
param group of its own with ``optim_bits`` 32, which survives DeepSpeed's wrappers: ZeRO and the
bf16 optimizer hand the optimizer flat tensors, one per group, so an override keyed by the
parameter itself would be lost.

bitsandbytes is an optional extra (``pip install 'megatron-deepspeed-3d[bnb]'``). It is imported,
and one 8-bit step is tried on the training device, when the optimizer is built; either failing
raises BitsAndBytesError saying what to install.
"""
import torch

INSTALL_HINT = "pip install 'megatron-deepspeed-3d[bnb]' (the optional extra 'bnb', i.e. pip install bitsandbytes)"
EMBEDDING_OPTIM_BITS = 32
_PROBE_SIZE = 4096  # bitsandbytes keeps smaller tensors' state in 32 bits; the probe must take the 8-bit path


class BitsAndBytesError(RuntimeError):
    """bitsandbytes is missing or cannot run its 8-bit optimizer here; the message says what to do."""


def import_bitsandbytes():
    """The bitsandbytes module, or BitsAndBytesError naming the extra."""
    try:
        import bitsandbytes
    except Exception as exc:  # an ImportError, or a broken native library raising at import
        raise BitsAndBytesError(f"--use-bnb-optimizer needs bitsandbytes, which cannot be imported "
                                f"({type(exc).__name__}: {exc}): {INSTALL_HINT}") from exc
    return bitsandbytes


def check_runs_on(bnb, device: torch.device) -> None:
    """One AdamW8bit step on a probe tensor on ``device``; BitsAndBytesError when it fails."""
    probe = torch.zeros(_PROBE_SIZE, device=device, requires_grad=True)
    probe.grad = torch.ones_like(probe)
    try:
        bnb.optim.AdamW8bit([probe], lr=1e-3).step()
    except Exception as exc:
        version = getattr(bnb, "__version__", "?")
        raise BitsAndBytesError(f"--use-bnb-optimizer: bitsandbytes {version} cannot run its 8-bit AdamW on "
                                f"this machine ({device.type}: {type(exc).__name__}: {exc}); install a "
                                f"bitsandbytes build for this platform ({INSTALL_HINT}) or drop the flag") from exc


def _adamw8bit_with_group_bits(bnb):
    class AdamW8bitWithGroupBits(bnb.optim.AdamW8bit):
        """AdamW8bit in which a param group may set ``optim_bits`` (32 for the embedding's group)."""

        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            config["optim_bits"] = group.get("optim_bits", config["optim_bits"])
            return config

    return AdamW8bitWithGroupBits


def adamw_8bit(param_groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
               device: torch.device) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit over ``param_groups`` (a group's ``optim_bits`` wins), checked on ``device``."""
    bnb = import_bitsandbytes()
    check_runs_on(bnb, device)
    return _adamw8bit_with_group_bits(bnb)(param_groups, lr=lr, betas=betas, eps=eps)


def with_embedding_in_32_bits(groups: list[dict], embedding_weights: list[torch.nn.Parameter]) -> list[dict]:
    """``groups`` with ``embedding_weights`` moved into a group of their own: the weight decay of the group
    they came from, and ``optim_bits`` 32."""
    moved = {id(weight) for weight in embedding_weights}
    result, embedding_groups = [], []
    for group in groups:
        kept = [param for param in group["params"] if id(param) not in moved]
        taken = [param for param in group["params"] if id(param) in moved]
        result.append({**group, "params": kept})
        if taken:
            embedding_groups.append({**group, "params": taken, "optim_bits": EMBEDDING_OPTIM_BITS})
    return result + embedding_groups
