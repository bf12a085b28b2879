"""The readable report of tools/model_calculator.py: its figures (``calculate``'s dict) as text."""
GIB = 2.0 ** 30


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}es" if noun.endswith("h") else f"{number} {noun}s"


def _giga(count: float) -> str:
    return f"{count / 1e9:,.3f} B" if count >= 1e9 else f"{count / 1e6:,.2f} M"


def _gib(size: float) -> str:
    return f"{size / GIB:8.2f}"


def _options(lay: dict) -> str:
    """The header's third line: attention, gradient accumulation and sequence parallelism."""
    options = ["materialized scores" if lay["materialized_attention"] else "fused (SDPA)"]
    if lay["fp32_grad_accumulation"]:
        immediate = lay["precision"] == "bf16" and lay["immediate_grad_update"]
        options.append("fp32 gradient accumulation" + (" (immediate_grad_update)" if immediate else ""))
    if lay["sequence_parallel"]:
        options.append("sequence parallel" + (" with TP comm overlap" if lay["tp_comm_overlap"] else ""))
    return "        attention: " + ", ".join(options)


def _format_header(figures: dict) -> list[str]:
    m, lay = figures["model"], figures["layout"]
    positions = {"absolute": "learned", "learned": "learned", "rope": "rotary"}.get(m["position_embedding_type"],
                                                                                  m["position_embedding_type"])
    recompute = "off"
    if lay["checkpoint_activations"] and lay["recompute_method"] == "block":
        recompute = f"full, the first {_count(lay['checkpoint_num_layers'], 'layer')} of each stage"
    elif lay["checkpoint_activations"]:
        recompute = f"full, {_count(lay['checkpoint_num_layers'], 'layer')} per chunk"
    elif lay["recompute_modules"]:
        recompute = "selective (" + " ".join(lay["recompute_modules"]) + ")"
    offload = [name for name, key in (("optimizer", "offload_optimizer"), ("weights", "offload_param")) if lay[key]]
    heads = _count(m['num_attention_heads'], 'head')
    if m["num_query_groups"] != m["num_attention_heads"]:
        heads += f" over {_count(m['num_query_groups'], 'key/value group')}"
    return [f"model:  {_count(m['num_layers'], 'layer')}, hidden {m['hidden_size']}, "
            f"{heads}, ffn {m['ffn_hidden_size']}{' SwiGLU' if m['swiglu'] else ''}, seq {m['seq_length']}, vocab "
            f"{m['vocab_size']} -> padded {m['padded_vocab_size']}, {positions} positions (max "
            f"{m['max_position_embeddings']}), {m['normalization']}"
            f"{', untied output' if m['untie_embeddings_and_output_weights'] else ''}"
            f"{', no biases' if not m['add_bias_linear'] else ''}{', QKV bias' if m['add_qkv_bias'] else ''}"
            f"{', embedding LayerNorm' if m['embed_layernorm'] else ''}",
            f"layout: {_count(lay['num_gpus'], 'GPU')} = TP {lay['tensor_parallel']} x PP {lay['pipeline_parallel']} "
            f"{'x Ulysses ' + str(lay['ulysses']) + ' ' if lay['ulysses'] > 1 else ''}"
            f"x DP {lay['data_parallel']}; micro batch {lay['micro_batch_size']}, global batch "
            f"{lay['global_batch_size']} ({_count(lay['micro_batches_per_step'], 'micro-batch')} per step); "
            f"{lay['precision']}, ZeRO "
            f"{lay['zero_stage']}{', offloaded to the host: ' + ' and '.join(offload) if offload else ''}, "
            f"recomputation {recompute}",
            _options(lay)]


def _table_names(parameters: dict) -> str:
    names = ["word"] + (["position"] if parameters["position_embeddings"] else []) \
        + (["output"] if parameters["output_layer"] else [])
    return (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]) + \
        (" tables" if len(names) > 1 else " table")


def _format_parameters(figures: dict) -> list[str]:
    p = figures["parameters"]
    lines = ["", "parameters (exact)",
             f"  total                 {_giga(p['total']):>14}  ({p['total']:,})",
             f"  without embeddings    {_giga(p['without_embeddings']):>14}  (less the {_table_names(p)})"]
    for stage, (layers, count) in enumerate(zip(p["layers_per_stage"], p["per_gpu"])):
        lines.append(f"  per GPU, stage {stage:<3}    {_giga(count):>14}  ({_count(layers, 'layer')})")
    return lines


def _heaviest_stage(figures: dict) -> dict:
    zero = str(figures["layout"]["zero_stage"])
    return max(figures["memory_per_gpu"]["stages"], key=lambda stage: stage["by_zero_stage"][zero]["total"])


def _format_memory(figures: dict) -> list[str]:
    lay, heaviest = figures["layout"], _heaviest_stage(figures)
    zero = str(lay["zero_stage"])
    lines = ["", f"memory per GPU, GiB (pipeline stage {heaviest['stage']}, the fullest GPU)",
             "                              ZeRO 0   ZeRO 1   ZeRO 2   ZeRO 3"]
    rows = (("weights", "weights"), ("gradients", "gradients"), ("optimizer states", "optimizer"),
            ("activations (estimate)", "activations"), ("total (estimate)", "total"))
    for label, key in rows:
        values = "".join(f" {_gib(heaviest['by_zero_stage'][str(z)][key])}" for z in heaviest["by_zero_stage"])
        lines.append(f"  {label:<26}{values}")
    if lay["offload_optimizer"] or lay["offload_param"]:
        values = "".join(f" {_gib(heaviest['by_zero_stage'][str(z)]['host'])}" for z in heaviest["by_zero_stage"])
        lines.append(f"  {'host memory (offload)':<26}{values}")
    if lay["pipeline_parallel"] > 1:
        lines.append("  (ZeRO 2 and 3 columns: DeepSpeed's pipeline engine runs neither with PP > 1)")
    lines.append(f"  activations of one layer and micro-batch without recomputation: "
                 f"{figures['memory_per_gpu']['activation_bytes_per_layer'] / GIB:.3f} GiB")
    for stage in figures["memory_per_gpu"]["stages"]:
        act = stage["activations"]
        lines.append(f"  stage {stage['stage']}: activations {act['total'] / GIB:.2f} GiB = {act['in_flight']} "
                     f"micro-batch(es) in flight x {act['per_micro_batch'] / GIB:.2f} + recomputed chunk "
                     f"{act['recompute'] / GIB:.2f} + logits {act['logits'] / GIB:.2f}; total at ZeRO {zero}: "
                     f"{stage['by_zero_stage'][zero]['total'] / GIB:.2f} GiB")
    return lines


def _format_flops(figures: dict) -> list[str]:
    f = figures["flops"]
    lines = ["", f"FLOPs per iteration ({f['tokens_per_iteration']:,} tokens)",
             f"  model FLOPs (forward + backward, no recomputation)   {f['model_flops_per_iteration']:.4e}",
             f"  hardware FLOPs with full recomputation               "
             f"{f['hardware_flops_per_iteration_with_recompute']:.4e}",
             f"  this run's hardware FLOPs                            "
             f"{f['this_run_hardware_flops_per_iteration']:.4e}",
             f"  model FLOPs per token                                {f['model_flops_per_token']:.4e}"]
    if "training" in f:
        run = f["training"]
        lines += ["", f"time to train {run['train_tokens']:,.0f} tokens at MFU {run['mfu']:.0%} of "
                      f"{run['peak_tflops']:g} TFLOP/s per GPU (estimate)",
                  f"  {run['iterations']:,} iterations, {run['tokens_per_second']:,.0f} tokens/s on "
                  f"{figures['layout']['num_gpus']} GPUs: {run['days']:.2f} days"]
    return lines


def format_report(figures: dict) -> str:
    """The figures of ``calculate`` as a readable report."""
    return "\n".join(_format_header(figures) + _format_parameters(figures) + _format_memory(figures)
                     + _format_flops(figures))
