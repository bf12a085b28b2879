"""What an autograd graph holds for backward."""
import torch


def saved_tensors(grad_fn, seen=None) -> list[torch.Tensor]:
    """Every tensor the graph behind ``grad_fn`` saved for backward."""
    seen = set() if seen is None else seen
    if grad_fn is None or grad_fn in seen:
        return []
    seen.add(grad_fn)
    saved = [value for name in dir(grad_fn) if name.startswith("_saved_")
             for value in [getattr(grad_fn, name)] if isinstance(value, torch.Tensor)]
    saved += [value for value in getattr(grad_fn, "saved_tensors", ()) if isinstance(value, torch.Tensor)]
    for next_fn, _ in grad_fn.next_functions:
        saved += saved_tensors(next_fn, seen)
    return saved

