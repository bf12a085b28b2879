import os, sys
if "LOCAL_RANK" in os.environ and os.path.basename(getattr(sys, "argv", [""])[0]) == "pretrain_gpt.py":
    import builtins
    _real_import = builtins.__import__
    _done = []

    def _report(label, optimizer):
        import torch
        rows = []
        def add(name, t):
            if t is not None:
                rows.append(f"{name}: {t.untyped_storage().nbytes() >> 20} MB pinned={t.is_pinned()}")
        for i, g in enumerate(getattr(optimizer, "fp16_partitioned_groups_flat", []) or []):
            add(f"fp16_flat[{i}]", g)
        for i, t in enumerate(getattr(optimizer, "param_groups_fp16_flat_cpu_memory", []) or []):
            add(f"fp16_cpu_memory[{i}]", t)
        for i, g in enumerate(optimizer.fp32_partitioned_groups_flat):
            add(f"fp32[{i}]", g)
            add(f"fp32[{i}].grad", g.grad)
        add("grad_partitions_flat_buffer", getattr(optimizer, "grad_partitions_flat_buffer", None))
        stats = {k: v >> 20 for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k and "current" in k}
        print(f"[pinprobe] {label}: host allocator {stats}\n[pinprobe]   " + "\n[pinprobe]   ".join(rows),
              file=sys.stderr, flush=True)

    def _patched_import(name, *args, **kwargs):
        module = _real_import(name, *args, **kwargs)
        if not _done and "megatron.training.engine.zero3" in sys.modules:
            zero3 = sys.modules["megatron.training.engine.zero3"]
            if hasattr(zero3, "share_offloaded_gradient_partitions"):
                _done.append(True)
                original = zero3.share_offloaded_gradient_partitions
                def wrapped(engine):
                    _report("before sharing", engine.optimizer)
                    freed = original(engine)
                    import gc; gc.collect()
                    _report("after sharing", engine.optimizer)
                    return freed
                zero3.share_offloaded_gradient_partitions = wrapped
        return module
    builtins.__import__ = _patched_import
