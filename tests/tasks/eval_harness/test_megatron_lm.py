"""tasks/eval_harness/megatron_lm.py: the harness's figures for our model equal those of its own
Hugging Face model (``HFLM``) on transformers' GPT2LMHeadModel holding the same weights, on the
offline local task group of local_tasks.py (every request kind, generation through the key/value
cache), request by request; two data-parallel replicas sharing the requests give one replica's answers.
"""
import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron.core.checkpoint.names import pipeline_name
from megatron.core.checkpoint.transformers_export import exported_layer, transformers_config
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core.text_generation.forward import PipelineForward
from megatron.core.text_generation.stage_model import InferenceStage
from megatron.core.tokenizer import GPT2BPETokenizer
from tests.core.models.gpt.gpt_test_utils import randomize_parameters, tiny_config
from tests.tasks.eval_harness.local_tasks import GROUP, TASKS, figures, write_local_tasks

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the harness's Hugging Face model needs it
SEQ_LENGTH = 32


def gpt2_weights(model: GPTModel, vocab_size: int) -> dict[str, torch.Tensor]:
    """transformers' GPT-2 state dict of ``model`` (through the exporter's per-layer mapping)."""
    config = dataclasses.asdict(model.config)
    layers = {}
    for name, tensor in model.state_dict().items():
        layer, _, rest = pipeline_name(name, config["num_layers"]).removeprefix("tied_modules.embed.").partition(".")
        key = (1, name.removeprefix("embedding.")) if name.startswith("embedding.") else (int(layer), rest)
        layers.setdefault(key[0], {})[key[1]] = tensor
    state = {}
    for layer, layer_state in layers.items():
        state.update(exported_layer(config, layer, layer_state, vocab_size))
    return state


def pipeline_of(model: GPTModel) -> PipelineForward:
    """``model``'s weights as the one-rank inference model the adapter runs."""
    stage = InferenceStage(model.config, single_rank_groups())
    stage.load_state_dict(model.state_dict())
    return PipelineForward(stage, single_rank_groups())


def evaluate(lm, include_path):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    return lm_eval.simple_evaluate(model=lm, tasks=[GROUP], task_manager=manager, bootstrap_iters=0,
                                   log_samples=True)


def tiny_model(tokenizer) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(tiny_config(padded_vocab_size=tokenizer.vocab_size + 60, seq_length=SEQ_LENGTH,
                                 max_position_embeddings=SEQ_LENGTH), single_rank_groups())
    randomize_parameters(model, seed=2)
    return model.eval()


def test_figures_equal_the_harness_hugging_face_model(tmp_path, gpt2_tokenizer_files):
    from tasks.eval_harness.megatron_lm import MegatronLM

    tokenizer = GPT2BPETokenizer(*gpt2_tokenizer_files)
    ours = tiny_model(tokenizer)
    config = transformers_config(dataclasses.asdict(ours.config), tokenizer.vocab_size, torch.float32)
    hf_config = transformers.GPT2Config(**config, bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod)
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    hf_model.load_state_dict(gpt2_weights(ours, tokenizer.vocab_size), strict=False)
    hf_tokenizer = transformers.GPT2TokenizerFast(*gpt2_tokenizer_files)
    from lm_eval.models.huggingface import HFLM

    include_path = write_local_tasks(str(tmp_path / "tasks"))
    theirs = evaluate(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, max_length=SEQ_LENGTH, batch_size=1,
                           device="cpu"), include_path)
    found = evaluate(MegatronLM(pipeline_of(ours), tokenizer, SEQ_LENGTH, batch_size=3), include_path)

    expected = figures(theirs)
    assert set(expected) >= {"tiny_choice/acc,none", "tiny_rolling/word_perplexity,none",
                             "tiny_generate/exact_match,none", "tiny_cloze/perplexity,none"}
    assert figures(found) == pytest.approx(expected, rel=1e-5)
    for task in TASKS:
        for mine, reference in zip(found["samples"][task], theirs["samples"][task], strict=True):
            if task == "tiny_generate":
                assert mine["resps"] == reference["resps"]
            else:
                assert torch.tensor(flatten(mine["resps"])).double().numpy() == pytest.approx(
                    torch.tensor(flatten(reference["resps"])).double().numpy(), rel=1e-5, abs=1e-5)
    assert any(sample["resps"][0][0] for sample in found["samples"]["tiny_generate"])  # text was generated
    print({name: round(value, 6) for name, value in figures(found).items()})


def flatten(responses):
    values = []
    for item in responses:
        values += flatten(item) if isinstance(item, (list, tuple)) else [float(item)]
    return values


def test_replicas_share_the_requests(gpt2_tokenizer_files):
    """Two replicas (threads meeting at a barrier to exchange their answers) return, each, the answers
    of one replica alone; three batches, so one replica answers two and the other one."""
    from tasks.eval_harness.megatron_lm import MegatronLM, Replicas

    tokenizer = GPT2BPETokenizer(*gpt2_tokenizer_files)
    model = pipeline_of(tiny_model(tokenizer))
    pairs = [(None, tokenizer.tokenize(context), tokenizer.tokenize(continuation)) for context, continuation in
             [("The function", " returns"), ("A list of", " values"), ("Hello", " world"), ("x =", " 1"),
              ("import", " os")]]
    prompts = [SimpleNamespace(args=(prompt, {"until": ["\n"], "max_gen_toks": 5})) for prompt in
               ("The return value is", "Example", "To open a file,", "def f(x):", "The module")]

    def answers(lm):
        return lm._loglikelihood_tokens(pairs), lm.generate_until(prompts)

    expected = answers(MegatronLM(model, tokenizer, SEQ_LENGTH, batch_size=2))
    barrier, exchanged, found = threading.Barrier(2), [None, None], [None, None]

    def gather(rank):
        def exchange(value):
            exchanged[rank] = value
            barrier.wait()
            shared = list(exchanged)
            barrier.wait()
            return shared
        return exchange

    def replica(rank):
        found[rank] = answers(MegatronLM(model, tokenizer, SEQ_LENGTH, batch_size=2,
                                         replicas=Replicas(rank, 2, gather(rank))))

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert found[0] == found[1]
    scores, texts = found[0]
    assert texts == expected[1] and any(texts)
    assert [score for score, _ in scores] == pytest.approx([score for score, _ in expected[0]], rel=1e-6)
    assert [greedy for _, greedy in scores] == [greedy for _, greedy in expected[0]]
