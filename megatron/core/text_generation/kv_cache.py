"""The key/value cache of incremental decoding.

Self-attention at step t needs the keys and values of every earlier position; they do not change
once computed (causal attention, fixed weights), so each layer keeps them and a step feeds only the
new tokens: K_{0..t} = [K_{0..t-1}; k_t], V likewise. A cache holds one layer's K and V as
[b, np, capacity, hn] buffers (np heads of this TP rank), allocated on the first call.
"""
import torch


class CacheFullError(RuntimeError):
    """More positions than the cache was made for."""


class LayerKVCache:
    """K and V of one layer for ``capacity`` positions: ``extend`` appends and returns the filled part."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value [b, np, s, hn] of positions length .. length + s - 1 -> K, V [b, np, length + s, hn]."""
        end = self.length + key.shape[-2]
        if end > self.capacity:
            raise CacheFullError(f"the key/value cache holds {self.capacity} positions, asked for {end}")
        if self.keys is None:
            shape = (*key.shape[:-2], self.capacity, key.shape[-1])
            self.keys = torch.empty(shape, dtype=key.dtype, device=key.device)
            self.values = torch.empty(shape, dtype=value.dtype, device=value.device)
        self.keys[:, :, self.length:end] = key
        self.values[:, :, self.length:end] = value
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def new_caches(num_layers: int, capacity: int) -> list[LayerKVCache]:
    """One empty cache per transformer layer of a stage."""
    return [LayerKVCache(capacity) for _ in range(num_layers)]
