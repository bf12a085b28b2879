"""tools/convert_checkpoint/deepspeed_to_transformers.py: a GPT-2-style and a BLOOM-style model trained
under TP=2 x PP=2 (4 gloo processes, fp32, 2 iterations) load with transformers'
AutoModelForCausalLM offline, and their logits equal ours on the same tokens: 1e-5 relative to the
largest logit (both are fp32 on the same weights; only the order of the sums differs). Options no
architecture expresses are refused by name.
"""
import json
import os

import pytest
import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.checkpoint.transformers_export import NotExportableError, architecture
from tests.training.e2e_utils import run_pretrain
from tests.training.test_layout_equivalence import common_flags
from tools.convert_checkpoint import deepspeed_to_transformers

TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]
STYLES = {"GPT2LMHeadModel": [], "BloomForCausalLM": ["--position-embedding-type", "alibi", "--embed-layernorm"]}
TOKENIZER_VOCABULARY = 1000


@pytest.fixture(scope="module", params=sorted(STYLES))
def trained(request, e2e_data, tmp_path_factory):
    """(architecture, the global_step2 directory of a TP=2 x PP=2 run of that style)."""
    save = str(tmp_path_factory.mktemp("trained") / "checkpoints")
    flags = common_flags(e2e_data, seq_length=32, num_layers=2, global_batch=4, train_iters=2)
    run_pretrain(flags + TP2_PP2 + STYLES[request.param] + ["--save", save, "--save-interval", "2"], nproc=4,
                 timeout=600).assert_ok()
    return request.param, os.path.join(save, "global_step2")


@pytest.mark.slow
@pytest.mark.distributed
def test_exported_model_gives_our_logits(trained, tmp_path):
    import transformers

    kind, checkpoint_directory = trained
    output = str(tmp_path / "hf")
    assert deepspeed_to_transformers.main(["--input_folder", checkpoint_directory, "--output_folder", output]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(output, local_files_only=True).eval()
    assert type(hf_model).__name__ == kind
    assert {"vocab.json", "merges.txt", "config.json", "model.safetensors.index.json"} <= set(os.listdir(output))
    with open(os.path.join(output, "vocab.json")) as f:
        assert hf_model.config.eos_token_id == json.load(f)["<|endoftext|>"]
    ours = load_gpt_model(open_checkpoint(checkpoint_directory))
    tokens = torch.randint(0, TOKENIZER_VOCABULARY, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)[..., :TOKENIZER_VOCABULARY]
        found = hf_model(tokens).logits
    assert found.shape == expected.shape
    assert (found - expected).abs().max() <= 1e-5 * expected.abs().max()


BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "kv_channels": 16, "ffn_hidden_size": 256,
        "position_embedding_type": "absolute", "glu_activation": None, "embed_layernorm": False,
        "apply_residual_connection_post_layernorm": False, "bias_gelu_fusion": True, "openai_gelu": False}


LLAMA = {**BASE, "normalization": "RMSNorm", "glu_activation": "swiglu", "bias_gelu_fusion": False,
         "position_embedding_type": "rotary", "rotary_percent": 1.0, "add_bias_linear": False, "num_query_groups": 2}


@pytest.mark.parametrize("changes, named", [
    ({"position_embedding_type": "rotary"}, "--normalization LayerNorm"),
    ({"glu_activation": "swiglu"}, "--position-embedding-type absolute"),
    ({"apply_residual_connection_post_layernorm": True}, "--apply-residual-connection-post-layernorm"),
    ({"position_embedding_type": "alibi"}, "ALiBi without --embed-layernorm"),
    ({"position_embedding_type": "alibi", "embed_layernorm": True, "ffn_hidden_size": 128}, "--ffn-hidden-size 128"),
    ({"embed_layernorm": True}, "--embed-layernorm with learned absolute positions"),
    ({**LLAMA, "normalization": "LayerNorm"}, "--normalization LayerNorm"),
    ({**LLAMA, "position_embedding_type": "alibi"}, "--position-embedding-type alibi"),
    ({**LLAMA, "glu_activation": "geglu"}, "--glu-activation geglu"),
    ({**LLAMA, "rotary_percent": 0.5}, "--rotary-percent 0.5"),
    ({**LLAMA, "add_bias_linear": True, "add_qkv_bias": True}, "--add-qkv-bias with biases on every linear layer"),
])
def test_options_no_architecture_expresses_are_refused_by_name(changes, named):
    with pytest.raises(NotExportableError, match=named):
        architecture({**BASE, **changes})
    assert architecture(BASE) == "GPT2LMHeadModel"
    assert architecture({**BASE, "position_embedding_type": "alibi", "embed_layernorm": True}) == "BloomForCausalLM"
    assert architecture(LLAMA) == "LlamaForCausalLM"
    assert architecture({**LLAMA, "add_qkv_bias": True}) == "Qwen2ForCausalLM"
    assert architecture({**LLAMA, "add_bias_linear": True, "num_query_groups": 4}) == "LlamaForCausalLM"
