"""GPTModel: HF GPT-2 parity, causality, document isolation, activation checkpointing, TP parity."""
import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.masks import get_ltor_masks_and_position_ids
from megatron.core.parallel_state import initialize_model_parallel, single_rank_groups
from megatron.core.tensor_parallel.random import model_parallel_seed
from tests.core.models.gpt.gpt_test_utils import (copy_full_weights, full_grads, full_weights, random_tokens,
                                                  randomize_parameters, relative_error, tiny_config)
from tests.autograd_utils import saved_tensors
from tests.dist_utils import run_distributed

EOD = 0


def build(config, seed=None):
    model = GPTModel(config, single_rank_groups())
    if seed is not None:
        randomize_parameters(model, seed)
    return model


def hf_state_dict(model, config):
    """Our weights under HF GPT2LMHeadModel's names. HF's Conv1D stores [in, out], and its c_attn
    output columns are [q (all heads); k; v] where ours are ordered per head [n, 3, hn]."""
    n, hn, h = config.num_attention_heads, config.kv_channels, config.hidden_size
    ours = {name: param.detach() for name, param in model.named_parameters()}
    state = {"transformer.wte.weight": ours["embedding.word_embeddings.weight"],
             "transformer.wpe.weight": ours["embedding.position_embeddings.weight"],
             "transformer.ln_f.weight": ours["final_layernorm.weight"],
             "transformer.ln_f.bias": ours["final_layernorm.bias"]}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"transformer.h.{i}."
        qkv_weight = ours[mine + "self_attention.query_key_value.weight"].view(n, 3, hn, h)
        qkv_bias = ours[mine + "self_attention.query_key_value.bias"].view(n, 3, hn)
        state[theirs + "attn.c_attn.weight"] = qkv_weight.transpose(0, 1).reshape(3 * n * hn, h).t()
        state[theirs + "attn.c_attn.bias"] = qkv_bias.transpose(0, 1).reshape(3 * n * hn)
        pairs = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
        for hf_name, our_name in pairs.items():
            for kind in ("weight", "bias"):
                state[f"{theirs}{hf_name}.{kind}"] = ours[f"{mine}{our_name}.{kind}"]
        linears = {"attn.c_proj": "self_attention.dense", "mlp.c_fc": "mlp.dense_h_to_4h",
                   "mlp.c_proj": "mlp.dense_4h_to_h"}
        for hf_name, our_name in linears.items():
            state[f"{theirs}{hf_name}.weight"] = ours[f"{mine}{our_name}.weight"].t()
            state[f"{theirs}{hf_name}.bias"] = ours[f"{mine}{our_name}.bias"]
    return state


def test_logits_match_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = tiny_config(num_layers=3, padded_vocab_size=96)
    model = build(config, seed=1).eval()
    hf_config = transformers.GPT2Config(
        vocab_size=96, n_positions=16, n_embd=32, n_layer=3, n_head=4, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model, config), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head is tied to wte
    tokens = random_tokens(2, 16, 96, seed=2)
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert ours.shape == theirs.shape == (2, 16, 96)
    assert relative_error(ours, theirs) < 1e-4


@pytest.mark.parametrize("kind, impl", [("absolute", "sdpa"), ("rotary", "sdpa"), ("alibi", "sdpa"),
                                        ("alibi", "materialized")])
def test_causality(kind, impl):
    model = build(tiny_config(position_embedding_type=kind, attention_impl=impl), seed=3).eval()
    tokens = random_tokens(2, 16, 64, seed=4)
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 64
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=1e-6)
    assert (before[:, 9:] - after[:, 9:]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("kind, impl", [("absolute", "sdpa"), ("rotary", "materialized"), ("alibi", "sdpa")])
def test_reset_attention_mask_isolates_documents(kind, impl):
    """A packed document sees only itself: its logits equal those of the document run alone."""
    model = build(tiny_config(position_embedding_type=kind, attention_impl=impl), seed=5).eval()
    second_document = torch.tensor([[7, 3, 9, 12, 40, 41, 5, 8, 6, EOD]])
    tokens = torch.cat((torch.tensor([[11, 22, 33, 44, 55, EOD]]), second_document), dim=1)
    masks = get_ltor_masks_and_position_ids(tokens, EOD, reset_position_ids=True, reset_attention_mask=True)
    changed = tokens.clone()
    changed[0, 2] = 60
    with torch.no_grad():
        packed = model(tokens, masks.position_ids, masks.attention_mask)
        packed_changed = model(changed, masks.position_ids, masks.attention_mask)
        alone = model(second_document)
    torch.testing.assert_close(packed[:, 6:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_changed[:, 6:], packed[:, 6:], rtol=0, atol=1e-6)
    assert not torch.allclose(packed_changed[:, 2:6], packed[:, 2:6])


def loss_and_grads(model, tokens, seed):
    model_parallel_seed(seed, tp_rank=0, pp_rank=0)
    model.zero_grad()
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("impl", ["sdpa", "materialized"])
def test_activation_checkpointing_with_dropout_is_exact(impl):
    config = tiny_config(num_layers=3, hidden_dropout=0.2, attention_dropout=0.2, attention_impl=impl,
                         seq_length=15)
    tokens = random_tokens(2, 16, 64, seed=6)
    plain = build(config, seed=7).train()
    loss, grads = loss_and_grads(plain, tokens, seed=8)
    for chunk in (1, 2):  # 2: chunks [1, 2] and [3]
        checkpointed = build(tiny_config(**{**config.__dict__, "checkpoint_activations": True,
                                            "checkpoint_num_layers": chunk}), seed=7).train()
        checkpointed_loss, checkpointed_grads = loss_and_grads(checkpointed, tokens, seed=8)
        assert torch.equal(loss, checkpointed_loss)
        for name, grad in grads.items():
            assert torch.equal(grad, checkpointed_grads[name]), name
    with torch.no_grad():
        eval_loss = plain.eval()(tokens[:, :-1], labels=tokens[:, 1:])
    assert abs(float(eval_loss) - float(loss)) > 1e-3  # dropout was really on


def test_fp32_residual_connection_in_bf16():
    config = tiny_config(params_dtype=torch.bfloat16, fp32_residual_connection=True)
    model = build(config)
    seen = []
    model.layers[1].register_forward_hook(lambda module, args, output: seen.append((args[0].dtype, output.dtype)))
    tokens = random_tokens(2, 16, 64, seed=9)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).detach()
    assert seen == [(torch.float32, torch.float32)]
    assert model.layers[0].mlp.dense_h_to_4h.weight.dtype == torch.bfloat16
    reference = build(tiny_config())(tokens[:, :-1], labels=tokens[:, 1:]).detach()
    assert abs(float(loss) - float(reference)) < 2e-2 * float(reference)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", ["sdpa", "materialized"])
def test_half_precision_parameters(dtype, impl):
    """fp16 / bf16 parameters (weights cast from the same fp32 draw) give nearly the fp32 loss and gradients."""
    tokens = random_tokens(2, 16, 64, seed=14)
    losses, grads = [], []
    for params_dtype in (torch.float32, dtype):
        model = build(tiny_config(params_dtype=params_dtype, attention_impl=impl, seq_length=15))
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        assert loss.dtype == torch.float32
        losses.append(float(loss.detach()))
        grads.append(model.layers[0].self_attention.query_key_value.weight.grad.float())
    assert model.layers[0].mlp.dense_h_to_4h.weight.dtype == dtype
    assert abs(losses[1] - losses[0]) < 1e-2 * losses[0]
    assert relative_error(grads[1], grads[0]) < 5e-2


def test_loss_is_masked_token_mean():
    model = build(tiny_config(), seed=10).eval()
    tokens = random_tokens(2, 16, 64, seed=11)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss_mask = torch.ones(2, 15)
    loss_mask[0, 3:] = 0.0
    with torch.no_grad():
        loss = model(inputs, labels=labels, loss_mask=loss_mask)
        logits = model(inputs).float()
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), reduction="none")
    expected = (per_token * loss_mask.reshape(-1)).sum() / loss_mask.sum()
    torch.testing.assert_close(loss, expected)


# Llama-class: RMSNorm, 8 heads over 4 key/value groups, SwiGLU, rotary with a large base, untied head,
# no biases (Qwen2: a bias on the query/key/value projection only).
LLAMA = dict(num_attention_heads=8, num_query_groups=4, normalization="RMSNorm", position_embedding_type="rotary",
             rotary_base=500000.0, glu_activation="swiglu", bias_gelu_fusion=False, ffn_hidden_size=48,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)


def hf_llama_state_dict(model, config):
    """Our weights under transformers' Llama / Qwen2 names: our query_key_value rows are per key/value
    group [g, q + 2, hn] (its q query heads, its key, its value), our dense_h_to_4h is [up; gate]."""
    g, q, hn = config.num_query_groups, config.queries_per_group, config.kv_channels
    ours = {name: param.detach() for name, param in model.named_parameters()}
    state = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"],
             "model.norm.weight": ours["final_layernorm.weight"], "lm_head.weight": ours["output_layer.weight"]}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            grouped = ours[f"{mine}self_attention.query_key_value.{kind}"].view(g, q + 2, hn, -1)
            state[f"{theirs}self_attn.q_proj.{kind}"] = grouped[:, :q].reshape(g * q * hn, -1).squeeze(-1)
            state[f"{theirs}self_attn.k_proj.{kind}"] = grouped[:, q].reshape(g * hn, -1).squeeze(-1)
            state[f"{theirs}self_attn.v_proj.{kind}"] = grouped[:, q + 1].reshape(g * hn, -1).squeeze(-1)
        up, gate = ours[f"{mine}mlp.dense_h_to_4h.weight"].chunk(2)
        state.update({f"{theirs}self_attn.o_proj.weight": ours[f"{mine}self_attention.dense.weight"],
                      f"{theirs}mlp.up_proj.weight": up, f"{theirs}mlp.gate_proj.weight": gate,
                      f"{theirs}mlp.down_proj.weight": ours[f"{mine}mlp.dense_4h_to_h.weight"],
                      f"{theirs}input_layernorm.weight": ours[f"{mine}input_layernorm.weight"],
                      f"{theirs}post_attention_layernorm.weight": ours[f"{mine}post_attention_layernorm.weight"]})
    return state


@pytest.mark.parametrize("variant", ["llama", "llama3_rope_scaling", "qwen2"])
def test_logits_match_hf_llama_class_models(variant):
    transformers = pytest.importorskip("transformers")
    overrides = dict(LLAMA, num_layers=3, padded_vocab_size=96, layernorm_epsilon=1e-6)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=4, rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  max_position_embeddings=64)
    if variant == "llama3_rope_scaling":
        overrides.update(use_rope_scaling=True, rope_scaling_factor=8.0, rope_scaling_low_freq_factor=1.0,
                         rope_scaling_high_freq_factor=4.0, rope_scaling_original_max_position_embeddings=8)
        common["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8)
    if variant == "qwen2":
        overrides["add_qkv_bias"] = True
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    config = tiny_config(**overrides)
    model = build(config, seed=3).eval()
    missing, unexpected = hf.load_state_dict(hf_llama_state_dict(model, config), strict=False)
    assert not missing and not unexpected
    tokens = random_tokens(2, 16, 96, seed=4)
    with torch.no_grad():
        ours, theirs = model(tokens), hf.eval()(tokens).logits
    assert relative_error(ours, theirs) < 1e-5


# --- tensor parallelism: 4 gloo processes --------------------------------------------------------------------

PARITY_CONFIGS = [
    dict(),
    dict(position_embedding_type="rotary", glu_activation="swiglu", bias_gelu_fusion=False, embed_layernorm=True),
    dict(position_embedding_type="alibi", attention_impl="materialized",
         apply_residual_connection_post_layernorm=True),
    dict(checkpoint_activations=True, distribute_checkpointed_activations=True, glu_activation="geglu",
         bias_gelu_fusion=False),
    dict(LLAMA, use_rope_scaling=True, rope_scaling_original_max_position_embeddings=8, rotary_percent=0.5),
    dict(LLAMA, add_qkv_bias=True, attention_impl="materialized", checkpoint_activations=True),
]


def _check_layout_init(config, groups):
    """With use_cpu_initialization the gathered TP weights are the TP = 1 model's, bit for bit."""
    reference = build(config)
    model = GPTModel(config, groups)
    gathered = full_weights(model.named_parameters(), groups.tp)
    for name, param in reference.named_parameters():
        assert torch.equal(gathered[name], param.detach()), f"tp={groups.tp_size} init differs: {name}"
    return reference, model


def _check_parity(config, groups, tokens, masks):
    reference, model = _check_layout_init(config, groups)
    randomize_parameters(reference, seed=12)
    copy_full_weights(model, {n: p.detach() for n, p in reference.named_parameters()}, groups.tp_rank,
                      groups.tp_size)
    batch = dict(position_ids=masks.position_ids, attention_mask=masks.attention_mask, loss_mask=masks.loss_mask)
    losses = []
    for net in (reference, model):
        loss = net(tokens[:, :-1], labels=tokens[:, 1:], **batch)
        loss.backward()
        losses.append(loss.detach())
    assert relative_error(losses[1], losses[0]) <= 1e-5, (config, losses)
    grads = full_grads(model.named_parameters(), groups.tp)
    for name, param in reference.named_parameters():
        error = relative_error(grads[name], param.grad)
        assert error <= 1e-5, f"tp={groups.tp_size} {name}: gradient error {error:.2e}"


# Sequence parallelism: the layer norms' and row-parallel biases' gradients are the TP sums of partial
# ones, the activations are split along the sequence (16 positions, divisible by 2 and 4).
SEQUENCE_PARALLEL_CONFIGS = [
    dict(sequence_parallel=True),
    dict(sequence_parallel=True, position_embedding_type="rotary", glu_activation="swiglu", bias_gelu_fusion=False,
         embed_layernorm=True),
    dict(sequence_parallel=True, position_embedding_type="alibi", attention_impl="materialized",
         checkpoint_activations=True, apply_residual_connection_post_layernorm=True),
    dict(LLAMA, sequence_parallel=True, tp_comm_overlap=True),
]


def _parity_batches(seq_length):
    """tokens [2, seq_length + 1] with two documents, and their plain and reset masks."""
    tokens = random_tokens(2, seq_length + 1, 64, seed=13)
    tokens[0, 5] = tokens[1, 9] = EOD
    plain = get_ltor_masks_and_position_ids(tokens[:, :-1], EOD, eod_mask_loss=True)
    reset = get_ltor_masks_and_position_ids(tokens[:, :-1], EOD, True, True, True)
    return tokens, plain, reset


def _tensor_parallel_worker(rank, world_size):
    for tp in (2, 4):
        groups = initialize_model_parallel(tensor_model_parallel_size=tp)
        for seq_length, configs in ((15, PARITY_CONFIGS), (16, SEQUENCE_PARALLEL_CONFIGS)):
            tokens, plain, reset = _parity_batches(seq_length)
            for overrides in configs:
                masks = reset if overrides.get("position_embedding_type") == "alibi" else plain
                _check_parity(tiny_config(seq_length=seq_length, **overrides), groups, tokens, masks)


@pytest.mark.distributed
def test_tensor_parallel_parity_and_layout_independent_init():
    run_distributed(_tensor_parallel_worker, 4)


@pytest.mark.parametrize("untied", [False, True])
def test_parameters_released_after_use_are_not_held_by_the_graph(untied):
    """Under ZeRO-3 (every parameter ``released_after_use``) no tensor saved for backward shares the memory
    of a parameter's data once the forward is done, so DeepSpeed's release frees it; the gradients after
    the parameters are gathered again are those of the unmarked model."""
    config = tiny_config(untie_embeddings_and_output_weights=untied)
    tokens = random_tokens(2, config.seq_length, config.padded_vocab_size)
    positions = torch.arange(config.seq_length)[None].expand(2, -1)
    model_parallel_seed(1234, 0, 0)
    reference, model = build(config, seed=3), build(config, seed=3)
    for param in model.parameters():
        param.released_after_use = True
    loss = model(tokens, positions, None).float().square().mean()
    gathered = {name: param.data for name, param in model.named_parameters()}
    memory = {param.untyped_storage().data_ptr(): name for name, param in model.named_parameters()}
    for param in model.parameters():
        param.data = torch.empty(0)
    held = {memory[t.untyped_storage().data_ptr()] for t in saved_tensors(loss.grad_fn)
            if t.untyped_storage().data_ptr() in memory}
    assert held == set()
    for name, param in model.named_parameters():
        param.data = gathered[name]
    loss.backward()
    reference(tokens, positions, None).float().square().mean().backward()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, msg=name)
