"""GPTModelPipe: layer list, partition methods, stage composition, and a real 2-stage DeepSpeed run."""
import pytest
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.masks import get_ltor_masks_and_position_ids
from megatron.training.engine.pipeline_module import (GPTModelPipe, LanguageModelLoss, PipelineInputError, SwapFirstDims,
                                               check_pipeline_inputs, gpt_layer_specs, stage_boundaries)
from megatron.core.parallel_state import initialize_model_parallel, single_rank_groups
from megatron.core.tensor_parallel.random import model_parallel_seed
from tests.core.models.gpt.gpt_test_utils import (copy_full_weights, full_grads, full_weights, random_tokens,
                                                  randomize_parameters, relative_error, tiny_config)
from tests.dist_utils import run_distributed

EOD = 0


def test_layer_list_follows_megatron_deepspeeds_numbering():
    specs = gpt_layer_specs(tiny_config(num_layers=3), single_rank_groups())
    names = [spec.typename.__name__ if isinstance(spec, LayerSpec) else spec.__name__ for spec in specs]
    assert names == ["check_pipeline_inputs", "EmbeddingPipe", "to_sequence_first",
                     "ParallelTransformerLayerPipe", "ParallelTransformerLayerPipe", "ParallelTransformerLayerPipe",
                     "to_batch_first", "LayerNorm", "EmbeddingPipe", "logits_for_fp32_loss"]
    assert isinstance(specs[1], TiedLayerSpec) and isinstance(specs[8], TiedLayerSpec)
    assert specs[1].key == specs[8].key == "embed" and specs[8].forward_fn is not None
    assert [spec.module_args[1] for spec in specs[3:6]] == [1, 2, 3]  # global 1-based layer numbers


@pytest.mark.parametrize("use_cpu_initialization", [False, True])
def test_layers_are_built_on_the_requested_device(use_cpu_initialization):
    """The trainer asks for the GPU; "meta" stands in for it here: no parameter may land elsewhere."""
    model_parallel_seed(1, 0, 0)
    config = tiny_config(num_layers=2, use_cpu_initialization=use_cpu_initialization)
    specs = gpt_layer_specs(config, single_rank_groups(), device=torch.device("meta"))
    built = [spec.build() for spec in specs if isinstance(spec, LayerSpec)]
    devices = {param.device.type for layer in built for param in layer.parameters()}
    assert len(built) == 5 and devices == {"meta"}


def _deepspeed_partition(specs, num_stages, method):
    """DeepSpeed's own PipelineModule._partition_layers, run on a stand-in without process groups."""
    stand_in = GPTModelPipe.__new__(GPTModelPipe)
    torch.nn.Module.__init__(stand_in)
    stand_in.num_stages, stand_in.global_rank, stand_in.loss_fn = num_stages, 1, None
    stand_in._topo = PipeModelDataParallelTopology(num_pp=num_stages, num_mp=1, num_dp=1)
    stand_in._layer_specs = specs
    stand_in._partition_layers(method=method)
    return [int(b) for b in stand_in.parts]


def test_partition_methods_for_24_layers_and_a_250k_vocabulary():
    """31 entries: 0 check, 1 embedding, 2 transpose, 3..26 layers, 27 transpose, 28 norm, 29 head, 30 logits for the fp32 loss.

    uniform: 31 entries over 4 stages = 8, 8, 8, 7 (the remainder goes to the first stages).
    type:transformer: 6 layers per stage; the stateless entries and the embedding ride along.
    type:transformer|embedding: 26 weighted entries (24 layers, embedding, head); the best balance is
      7/7/6/6 and DeepSpeed's DP keeps the latest split among equal costs, so the first stages get 7:
      stage 0 = embedding + layers 3..8, stage 1 = layers 9..15, stage 2 = 16..21, stage 3 = 22..26 + head.
    parameters: embedding and head (250880 x 64 each) dwarf a layer (~50k): each gets a stage alone,
      the 24 layers split 12/12 between the middle stages; the final norm (128 parameters) joins stage 2
      (equal cost either way, the later split wins).
    """
    config = tiny_config(num_layers=24, hidden_size=64, padded_vocab_size=250880, use_cpu_initialization=False)
    model_parallel_seed(1, 0, 0)
    specs = gpt_layer_specs(config, single_rank_groups())
    expected = {
        "uniform": [0, 8, 16, 24, 31],
        "type:transformer": [0, 9, 15, 21, 31],
        "type:transformer|embedding": [0, 9, 16, 22, 31],
        "parameters": [0, 3, 15, 29, 31],
    }
    for method, boundaries in expected.items():
        assert [int(b) for b in stage_boundaries(specs, 4, method)] == boundaries, method
        assert _deepspeed_partition(specs, 4, method) == boundaries, method
    with pytest.raises(ValueError, match="--pp-partition-method"):
        stage_boundaries(specs, 4, "profile")
    with pytest.raises(ValueError, match="matches no layer"):
        stage_boundaries(specs, 4, "type:decoder")


def test_flops_partition_weighs_the_output_head():
    """h = 64, s = 64: a layer is 24h^2 + 4sh = 114688 FLOPs per token and the head 2hV; at V = 1792 the
    head weighs two layers, so 24 layers over 2 stages split 13 / 11 + head (entries 0-15 / 16-30),
    where one unit per transformer layer splits them 12 / 12 (entries 0-14 / 15-30)."""
    config = tiny_config(num_layers=24, hidden_size=64, seq_length=64, max_position_embeddings=64,
                         padded_vocab_size=1792, use_cpu_initialization=False)
    model_parallel_seed(1, 0, 0)
    specs = gpt_layer_specs(config, single_rank_groups())
    assert stage_boundaries(specs, 2, "flops") == [0, 16, 31]
    assert [int(b) for b in stage_boundaries(specs, 2, "type:transformer")] == [0, 15, 31]
    assert stage_boundaries(specs, 1, "FLOPS") == [0, 31]


def _build_stages(specs, boundaries):
    """Instantiate the specs stage by stage (a tied module is built once and shared, as DeepSpeed does)."""
    tied, stages = {}, []
    for start, stop in zip(boundaries[:-1], boundaries[1:]):
        functions = []
        for spec in specs[start:stop]:
            if isinstance(spec, TiedLayerSpec):
                module = tied.setdefault(spec.key, spec.build())
                functions.append(module if spec.forward_fn is None else
                                 (lambda x, module=module, fn=spec.forward_fn: fn(module, x)))
            elif isinstance(spec, LayerSpec):
                functions.append(spec.build())
            else:
                functions.append(spec)
        stages.append(functions)
    return stages


def _run(functions, x):
    for function in functions:
        x = function(x)
    return x


@pytest.mark.parametrize("reset", [False, True])
def test_composed_stages_equal_gpt_model(reset):
    config = tiny_config(num_layers=4, position_embedding_type="rotary", embed_layernorm=True)
    tokens = random_tokens(2, 16, 64, seed=1)
    tokens[0, 6] = EOD
    masks = get_ltor_masks_and_position_ids(tokens[:, :-1], EOD, reset, reset, True)
    inputs = (tokens[:, :-1], masks.position_ids) + ((masks.attention_mask,) if reset else ())
    specs = gpt_layer_specs(config, single_rank_groups())
    boundaries = stage_boundaries(specs, 2, "type:transformer")
    first, second = _build_stages(specs, boundaries)
    with torch.no_grad():
        logits = _run(second, _run(first, check_pipeline_inputs(inputs)))
        loss = LanguageModelLoss(None)(logits, (tokens[:, 1:], masks.loss_mask))
        model = GPTModel(config, single_rank_groups()).eval()
        expected_logits = model(tokens[:, :-1], masks.position_ids, masks.attention_mask)
        expected_loss = model(tokens[:, :-1], masks.position_ids, masks.attention_mask, tokens[:, 1:], masks.loss_mask)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, expected_loss)


def test_the_residual_streams_gradient_stays_contiguous():
    """The layers hand back contiguous gradients: a strided one from the transposes around the layers
    would cost every layer's backward a strided add and a copy (SwapFirstDims)."""
    config = tiny_config(num_layers=3)
    tokens = random_tokens(2, 16, 64, seed=1)
    masks = get_ltor_masks_and_position_ids(tokens[:, :-1], EOD, False, False, True)
    specs = gpt_layer_specs(config, single_rank_groups())
    stages = _build_stages(specs, stage_boundaries(specs, 1, "uniform"))
    layouts = []
    x = check_pipeline_inputs((tokens[:, :-1], masks.position_ids))
    for function in stages[0]:
        x = function(x)
        if type(function).__name__ == "ParallelTransformerLayerPipe":
            x[0].register_hook(lambda grad: layouts.append(grad.is_contiguous()))
    LanguageModelLoss(None)(x, (tokens[:, 1:], masks.loss_mask)).backward()
    assert layouts == [True, True, True]


def test_swap_first_dims_gives_the_transposes_values_and_gradient():
    x = torch.randn(4, 3, 5, requires_grad=True)
    weights = torch.randn(3, 4, 5)
    (SwapFirstDims.apply(x) * weights).sum().backward()
    assert SwapFirstDims.apply(x).is_contiguous()
    torch.testing.assert_close(SwapFirstDims.apply(x), x.transpose(0, 1), rtol=0, atol=0)
    assert x.grad.is_contiguous()
    torch.testing.assert_close(x.grad, weights.transpose(0, 1), rtol=0, atol=0)


def test_pipeline_input_validation():
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(PipelineInputError, match="tokens, position_ids"):
        check_pipeline_inputs((tokens,))
    with pytest.raises(PipelineInputError, match="integer tensors"):
        check_pipeline_inputs((tokens.float(), tokens))
    with pytest.raises(PipelineInputError, match="bool"):
        check_pipeline_inputs((tokens, tokens, torch.zeros(2, 1, 8, 8)))


# --- a real DeepSpeed PipelineModule over 2 stages x 2 TP ranks (4 gloo processes) ----------------------------

NUM_LAYERS = 4


def _reference_name(pipe_name):
    """GPTModelPipe parameter name -> GPTModel parameter name (layer indices as in the module docstring)."""
    head, _, rest = pipe_name.partition(".")
    if head == "tied_modules":
        return "embedding." + rest.partition(".")[2]
    index = int(head)
    if index == NUM_LAYERS + 4:
        return "final_layernorm." + rest
    return f"layers.{index - 3}.{rest}"


def _pipeline_step(module, groups, tokens, masks):
    """One forward and backward over the two stages, activations and their gradients sent by hand."""
    peer = groups.pp_ranks[1 - groups.pp_rank]
    extras = (masks.position_ids, masks.attention_mask)
    module.zero_grad()
    loss = None
    if groups.is_first_stage:
        hidden = module((tokens[:, :-1], *extras))[0]
        dist.send(hidden.detach().contiguous(), peer)
        gradient = torch.empty_like(hidden)
        dist.recv(gradient, peer)
        hidden.backward(gradient)
    else:
        hidden = torch.empty(15, 2, 32)  # [s, b, h]
        dist.recv(hidden, peer)
        hidden.requires_grad_(True)
        logits = module((hidden, *extras))
        loss = module.loss_fn(logits, (tokens[:, 1:], masks.loss_mask))
        loss.backward()
        dist.send(hidden.grad, peer)
    module.allreduce_tied_weight_gradients()
    return loss


def _pipeline_worker(rank, world_size):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    groups = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    config = tiny_config(num_layers=NUM_LAYERS, seq_length=15, hidden_dropout=0.1, attention_dropout=0.1,
                         position_embedding_type="alibi")
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    module = GPTModelPipe(config, groups, topology, partition_method="flops")  # ours; DeepSpeed's: e2e runs
    assert [int(b) for b in module.parts] == stage_boundaries(gpt_layer_specs(config, groups), 2, "flops")
    reference = GPTModel(config, single_rank_groups())
    gathered = full_weights(module.named_parameters(), groups.tp)
    for name, weight in gathered.items():
        assert torch.equal(weight, dict(reference.named_parameters())[_reference_name(name)]), name

    randomize_parameters(reference, seed=2)
    reference_weights = {n: p.detach() for n, p in reference.named_parameters()}
    copy_full_weights(module, reference_weights, groups.tp_rank, groups.tp_size, names=_reference_name)
    tokens = random_tokens(2, 16, 64, seed=3)
    tokens[1, 7] = EOD
    masks = get_ltor_masks_and_position_ids(tokens[:, :-1], EOD, True, True, True)

    module.eval()
    reference.eval()
    loss = _pipeline_step(module, groups, tokens, masks)
    expected = reference(tokens[:, :-1], masks.position_ids, masks.attention_mask, tokens[:, 1:], masks.loss_mask)
    expected.backward()
    if loss is not None:
        assert relative_error(loss.detach(), expected.detach()) <= 1e-5
    grads = full_grads(module.named_parameters(), groups.tp)
    reference_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in grads.items():
        error = relative_error(grad, reference_grads[_reference_name(name)])
        assert error <= 1e-5, f"stage {groups.pp_rank} {name}: gradient error {error:.2e}"

    module.train()
    runs = []
    for interval in (0, 1):
        module.set_checkpoint_interval(interval)
        model_parallel_seed(1234, groups.tp_rank, groups.pp_rank)
        loss = _pipeline_step(module, groups, tokens, masks)
        runs.append((loss, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}))
    (plain_loss, plain_grads), (checkpointed_loss, checkpointed_grads) = runs
    if plain_loss is not None:
        assert torch.equal(plain_loss, checkpointed_loss)
        assert abs(float(plain_loss) - float(expected.detach())) > 1e-4  # dropout was on
    # recomputation redoes the same arithmetic; only the order of a few gradient reductions can differ (1 ulp)
    for name, grad in plain_grads.items():
        assert relative_error(checkpointed_grads[name], grad) <= 1e-6, name


@pytest.mark.distributed
def test_two_stage_pipeline_matches_single_model():
    run_distributed(_pipeline_worker, 4)
