"""What DeepSpeed's universal checkpoint needs to know about our parameters.

DeepSpeed's ``ds_to_universal`` merges each parameter's ZeRO fragments into one full tensor per
TP rank, then joins the TP slices by the regex patterns of the ``universal_checkpoint_info`` entry
of the model-states file; its ``load_universal`` loader cuts them again for the new TP size. The
patterns say what partitions.py says, in DeepSpeed's vocabulary (names are those of the pipeline
module, e.g. ``tied_modules.embed.word_embeddings.weight``, ``5.self_attention.dense.weight``,
``8.weight`` for the final norm):

    averaged over TP       LayerNorms, the position table, the row-parallel biases (copies that are
                           equal; averaging keeps them exact)
    joined along dim 1     the row-parallel weights
    joined along dim 0     everything else (column-parallel weights and biases, word embeddings)
    two halves             a GLU's first MLP weight and bias: each rank holds [A_r; G_r], joined as
                           [A; G]
    vocabulary             the word embeddings: padding rows stripped to the original vocabulary
                           and padded again for the new TP size
    pipeline-replicated    the embedding module, held by the first and the last stage: only its word
                           embeddings are tied (their gradients summed over the two stages); the last
                           stage's position table and embedding norm are unused copies that drift
                           (weight decay without gradient), so the first stage's are the weights
"""
from megatron.core.checkpoint.partitions import GLU_STRIDED, ROW_PARALLEL, VOCABULARY

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # DeepSpeed's key in the model-states file
# Parameters every TP rank holds in full (names end so).
TP_REPLICATED = (r".*layernorm\.(weight|bias)$", r".*self_attention\.dense\.bias$", r".*mlp\.dense_4h_to_h\.bias$")
PIPELINE_FINAL_NORM = r"^\d+\.(weight|bias)$"  # the plain module's is final_layernorm.*, matched above
POSITION_TABLE = r".*position_embeddings\.weight$"
EMBEDDING_MODULE = r"^tied_modules\.embed\."


def _patterns(names) -> list[str]:
    return [r".*" + name.replace(".", r"\.") + "$" for name in names]


def universal_checkpoint_info(glu: bool, learned_positions: bool, pipeline: bool, padded_vocab_size: int,
                              original_vocab_size: int) -> dict:
    """The ``universal_checkpoint_info`` entry for a GPT model (module docstring); ``glu``: the MLP
    is gated, so its first weight and bias are two halves; ``learned_positions``: the model has a
    position table; ``pipeline``: the names are the pipeline module's (names.py). DeepSpeed refuses
    a pattern that matches no parameter, so only the model's are listed."""
    two_halves = _patterns(GLU_STRIDED) if glu else []
    averaged = list(TP_REPLICATED) + ([POSITION_TABLE] if learned_positions else [])
    averaged += [PIPELINE_FINAL_NORM] if pipeline else []
    return {
        "universal_checkpoint_version": 0.2,
        "original_vocab_size": original_vocab_size,
        "padded_vocab_size": padded_vocab_size,
        "vocabulary_parameter_patterns": _patterns(VOCABULARY),
        "pipeline_replicated_parameter_patterns": [EMBEDDING_MODULE],
        "parameter_to_average_patterns": averaged,
        "parameter_with_row_parallelism_patterns": _patterns(ROW_PARALLEL),
        "parameter_with_2_sub_params_cat_dim_0": two_halves,
    }
