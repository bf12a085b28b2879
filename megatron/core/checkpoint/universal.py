"""What DeepSpeed's universal checkpoint needs to know about our parameters.

DeepSpeed's ``ds_to_universal`` merges each parameter's ZeRO fragments into one full tensor per
TP rank, then joins the TP slices by the regex patterns of the ``universal_checkpoint_info`` entry
of the model-states file; its ``load_universal`` loader cuts them again for the new TP size. The
patterns say what the model's layers mark on their parameters (sharding.py), in DeepSpeed's
vocabulary: one pattern per parameter of a transformer layer, its layer index matching any index, and
one per other parameter, its name exact (the final norm's ``L+4.weight`` and the untied output layer's
``L+5.weight`` differ only by the index). Names are the plain or the pipeline module's, e.g.
``tied_modules.embed.word_embeddings.weight``, ``5.self_attention.dense.weight``, ``8.weight``:

    averaged over TP       LayerNorms, the position table, the row-parallel biases (copies that are
                           equal; averaging keeps them exact)
    joined along dim 1     the row-parallel weights
    joined along dim 0     everything else (column-parallel weights and biases, word embeddings, the
                           untied output layer)
    two halves             stride 2, a GLU's first MLP weight and bias: each rank holds [A_r; G_r],
                           joined as [A; G]
    vocabulary             the word embeddings and the untied output layer: padding rows stripped to
                           the original vocabulary
                           and padded again for the new TP size
    pipeline-replicated    the embedding module, held by the first and the last stage: only its word
                           embeddings are tied (their gradients summed over the two stages); the last
                           stage's position table and embedding norm are unused copies that drift
                           (weight decay without gradient), so the first stage's are the weights
"""
import re

import torch

from megatron.core.checkpoint.names import PIPELINE_EMBEDDING_PREFIX, pipeline_name
from megatron.core.checkpoint.sharding import ModelSharding

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # DeepSpeed's key in the model-states file
EMBEDDING_MODULE = "^" + re.escape(PIPELINE_EMBEDDING_PREFIX)
_LAYER_INDEX = re.compile(r"^(layers\.)?\d+\.(.+)$")
TRANSFORMER_LAYER_PREFIX = "layers."  # the plain module's names of the transformer layers' parameters


def parameter_pattern(name: str) -> str:
    """The pattern of the transformer-layer parameter ``name`` in every layer: its layer index matches any index."""
    match = _LAYER_INDEX.match(name)
    if match is None:
        return f"^{re.escape(name)}$"
    return f"^{re.escape(match[1] or '')}\\d+\\.{re.escape(match[2])}$"


def _patterns(sharding: ModelSharding, pipeline: bool, wanted) -> list[str]:
    """The patterns of the parameters whose split is ``wanted``, in the model's order, each once:
    a transformer layer's with any layer index, the others exact (module docstring)."""
    patterns = []
    for name, split in sharding.splits.items():
        if wanted(split):
            saved = pipeline_name(name, sharding.num_layers) if pipeline else name
            patterns.append(parameter_pattern(saved) if name.startswith(TRANSFORMER_LAYER_PREFIX)
                            else f"^{re.escape(saved)}$")
    return list(dict.fromkeys(patterns))


def universal_info(sharding: ModelSharding, pipeline: bool, padded_vocab_size: int, original_vocab_size: int) -> dict:
    """The ``universal_checkpoint_info`` entry of a GPT model whose parameters ``sharding`` splits
    (module docstring); ``pipeline``: the names are the pipeline module's (names.py). DeepSpeed refuses
    a pattern that matches no parameter, so each names parameters of the model."""
    odd = [name for name, split in sharding.splits.items() if split.stride > 1 and (split.stride, split.dim) != (2, 0)]
    if odd:
        raise ValueError(f"{odd[0]}: a universal checkpoint joins strided partitions only as 2 halves of dimension 0")
    return {
        "universal_checkpoint_version": 0.2,
        "original_vocab_size": original_vocab_size,
        "padded_vocab_size": padded_vocab_size,
        "vocabulary_parameter_patterns": _patterns(sharding, pipeline, lambda split: split.vocabulary),
        "pipeline_replicated_parameter_patterns": [EMBEDDING_MODULE],
        "parameter_to_average_patterns": _patterns(sharding, pipeline, lambda split: split.replicated),
        "parameter_with_row_parallelism_patterns": _patterns(sharding, pipeline, lambda split: split.dim == 1),
        "parameter_with_2_sub_params_cat_dim_0": _patterns(sharding, pipeline, lambda split: split.stride == 2),
    }


def tp_share_of_universal(entry: dict, tp_rank: int, tp_size: int, vocab_rows: int | None = None) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of a universal ``{fp32,exp_avg,exp_avg_sq}.pt`` entry, cut as DeepSpeed's
    universal load cuts it: whole when it has no ``cat_dim`` (replicated); else each of its
    ``param_n_sub_params`` parts split in ``tp_size`` along ``cat_dim`` and this rank's pieces joined;
    a ``vocab_tensor`` first zero-padded to ``vocab_rows`` (the target's padded vocabulary)."""
    full = entry["param"]
    if "cat_dim" not in entry:
        return full
    dim = entry["cat_dim"]
    if entry.get("vocab_tensor") and vocab_rows is not None and vocab_rows > full.shape[0]:
        full = torch.nn.functional.pad(full, (0, 0, 0, vocab_rows - full.shape[0]))
    parts = full.chunk(entry.get("param_n_sub_params", 1), dim=dim)
    return torch.cat([part.chunk(tp_size, dim=dim)[tp_rank] for part in parts], dim=dim)
