"""A Llama-class GPT (RMSNorm, 4 heads over 2 key/value groups, SwiGLU, rotary base 500000, untied
output layer, no biases) trains the same under every parallel layout: DP=2 at ZeRO-2 (the plain
module), TP=2 with --sequence-parallel, --tp-comm-overlap and --checkpoint-activations, PP=2 split
by --pp-partition-method flops with --checkpoint-activations, and TP=2 x PP=2 with
--sequence-parallel give the single process's losses and gradient norms, iteration by iteration,
and the single process equals a plain PyTorch AdamW loop (reference_loop.py) on the same model.

Set-up: test_layout_equivalence's flags and tolerances (its docstring says why: fp32, dropout 0,
CPU initialization, the vocabulary padded to 1152, weight decay 1.0 and clipping at 1.0, losses
1e-5 and gradient norms 1e-4 relative), with the model of parallel_3d_runs.llama_flags: 2 layers,
hidden 64, ffn 128 (--swiglu's default), sequence 32, global batch 4, 4 iterations. The TP=2 x PP=2
run is the session fixture ``llama_saving_run`` (it saves at iteration 2 for the checkpoint tools'
tests); its files show the untied head and the grouped QKV split by groups.
"""
import pytest
import torch

from megatron.core.models.gpt import GPTModelConfig
from tests.training.parallel_3d_runs import (LLAMA_GLOBAL_BATCH, LLAMA_NUM_LAYERS, LLAMA_SAVE_ITERATION,
                                             LLAMA_SEQ_LENGTH, LLAMA_TRAIN_ITERS, llama_flags, train)
from tests.training.reference_loop import ReferenceSchedule, run_reference_loop, training_dataset
from tests.training.test_layout_equivalence import (DECAY_ITERS, GRAD_NORM_RTOL, LOSS_RTOL, LR, MAX_POSITIONS, MIN_LR,
                                                    SEED, WARMUP_ITERS, WEIGHT_DECAY,
                                                    assert_counters_of_every_iteration)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = list(range(1, LLAMA_TRAIN_ITERS + 1))
HIDDEN, HEADS, GROUPS, FFN, PADDED_VOCAB = 64, 4, 2, 128, 1152
# name -> (processes, layout flags); "tp2-pp2-sp" is llama_saving_run
LAYOUTS = {
    "single": (1, []),
    "dp2-zero2": (2, ["--zero-stage", "2"]),
    "tp2-sp-overlap-recompute": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap",
                                     "--checkpoint-activations"]),
    "pp2-flops-recompute": (2, ["--pipeline-model-parallel-size", "2", "--pp-partition-method", "flops",
                                "--checkpoint-activations"]),
}


@pytest.fixture(scope="module")
def runs(e2e_data, llama_saving_run, tmp_path_factory) -> dict:
    """name -> parallel_3d_runs.train() of each layout."""
    found = {name: train(llama_flags(e2e_data) + flags, processes, str(tmp_path_factory.mktemp(f"tb_llama_{name}")),
                         STEPS) for name, (processes, flags) in LAYOUTS.items()}
    found["tp2-pp2-sp"] = llama_saving_run
    return found


@pytest.mark.parametrize("name", [*(name for name in LAYOUTS if name != "single"), "tp2-pp2-sp"])
def test_llama_layout_matches_the_single_process_run(runs, name):
    run, single = runs[name], runs["single"]
    assert_counters_of_every_iteration(run["lines"], name, LLAMA_TRAIN_ITERS, LLAMA_GLOBAL_BATCH, LLAMA_SEQ_LENGTH)
    assert run["loss"] == pytest.approx(single["loss"], rel=LOSS_RTOL)
    assert run["grad_norm"] == pytest.approx(single["grad_norm"], rel=GRAD_NORM_RTOL)
    assert run["lr"] == pytest.approx(single["lr"], rel=1e-6)


def test_flops_partition_puts_the_output_layer_on_its_own_stage(runs):
    """Per token a transformer layer costs 81920 FLOPs and the untied head 2hV = 147456: the flops
    split gives stage 0 both transformer layers and stage 1 the final norm and the head."""
    output = runs["pp2-flops-recompute"]["output"]
    stage_1 = output[output.index("stage=1 layers="):]
    assert "OutputLayerPipe" in stage_1 and "ParallelTransformerLayerPipe" not in stage_1
    assert output[output.index("stage=0 layers="):output.index("stage=1 layers=")].count(
        "ParallelTransformerLayerPipe") == LLAMA_NUM_LAYERS


def test_single_process_matches_a_plain_pytorch_adamw_loop(runs, e2e_data):
    model = GPTModelConfig(num_layers=LLAMA_NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                           num_query_groups=GROUPS, padded_vocab_size=PADDED_VOCAB, seq_length=LLAMA_SEQ_LENGTH,
                           max_position_embeddings=MAX_POSITIONS, position_embedding_type="rotary",
                           rotary_base=500000.0, normalization="RMSNorm", glu_activation="swiglu",
                           bias_gelu_fusion=False, ffn_hidden_size=FFN, untie_embeddings_and_output_weights=True,
                           add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                           use_cpu_initialization=True, seed=SEED)
    schedule = ReferenceSchedule(batch_sizes=(LLAMA_GLOBAL_BATCH,) * LLAMA_TRAIN_ITERS, lr=LR, min_lr=MIN_LR,
                                 warmup_samples=WARMUP_ITERS * LLAMA_GLOBAL_BATCH,
                                 decay_samples=DECAY_ITERS * LLAMA_GLOBAL_BATCH, decay_style="cosine",
                                 weight_decay=WEIGHT_DECAY, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                 clip_grad=1.0)
    dataset = training_dataset(e2e_data.data_prefix, LLAMA_SEQ_LENGTH, SEED, LLAMA_TRAIN_ITERS * LLAMA_GLOBAL_BATCH,
                               e2e_data.cache_dir)
    reference = run_reference_loop(model, dataset, schedule)
    single = runs["single"]
    assert len(set(round(loss, 4) for loss in single["loss"])) == LLAMA_TRAIN_ITERS  # the model learns
    assert single["loss"] == pytest.approx([step.loss for step in reference], rel=LOSS_RTOL)
    assert single["grad_norm"] == pytest.approx([step.grad_norm for step in reference], rel=GRAD_NORM_RTOL)


def test_saved_files_hold_the_untied_head_and_the_grouped_qkv_split_by_groups(llama_saving_run):
    """Per TP rank: the untied output layer (layer L + 5, key ``weight``) holds half the vocabulary
    rows, QKV (n + 2g) hn / tp = 64 rows (one key/value group with its two query heads), SwiGLU's
    first MLP weight 2 ffn / tp rows; no biases; the RMSNorms have weights only."""
    tag = llama_saving_run["save"] / f"global_step{LLAMA_SAVE_ITERATION}"
    head_dim = HIDDEN // HEADS
    for rank in range(2):
        head = torch.load(tag / f"layer_{LLAMA_NUM_LAYERS + 5:02d}-model_{rank:02d}-model_states.pt", weights_only=True)
        assert {key: tuple(t.shape) for key, t in head.items()} == {"weight": (PADDED_VOCAB // 2, HIDDEN)}
        words = torch.load(tag / f"layer_01-model_{rank:02d}-model_states.pt", weights_only=True)
        assert not torch.equal(words["word_embeddings.weight"], head["weight"])
        layer = torch.load(tag / f"layer_03-model_{rank:02d}-model_states.pt", weights_only=True)
        assert {key: tuple(t.shape) for key, t in layer.items()} == {
            "input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,),
            "self_attention.query_key_value.weight": ((HEADS + 2 * GROUPS) * head_dim // 2, HIDDEN),
            "self_attention.dense.weight": (HIDDEN, HIDDEN // 2),
            "mlp.dense_h_to_4h.weight": (2 * FFN // 2, HIDDEN), "mlp.dense_4h_to_h.weight": (HIDDEN, FFN // 2)}
        final_norm = torch.load(tag / f"layer_{LLAMA_NUM_LAYERS + 4:02d}-model_{rank:02d}-model_states.pt",
                                weights_only=True)
        assert list(final_norm) == ["weight"]
