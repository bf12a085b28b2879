"""The key/value cache of incremental decoding.

Self-attention at step t needs the keys and values of every earlier position; they do not change
once computed (causal attention, fixed weights), so each layer keeps them and a step feeds only the
new tokens: K_{0..t} = [K_{0..t-1}; k_t], V likewise. A cache holds one layer's K and V as
[b, np, capacity, hn] buffers (np heads of this TP rank), allocated on the first call.

``extend(key, value)`` is what attention calls (ParallelSelfAttention.forward): it stores the new
keys and values and returns (K, V, mask, query positions) to attend over. Two kinds:

* LayerKVCache: K, V are the filled prefix [b, np, t + s, hn]; mask and positions None (the new
  queries are the last s positions: the plain bottom-right causal mask).
* StaticKVCache: K, V are the whole buffers [b, np, capacity, hn], the mask hides every key past
  each query's position, and the positions [s] place ALiBi's distances; the write position is a
  device tensor shared by the layers
  (StaticKVCaches.position). Every decode step then has the same shapes and no host value, so the
  step can be captured once as a CUDA graph and replayed (forward.py).
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

    def extend(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
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
        return self.keys[:, :, :end], self.values[:, :, :end], None, None


def new_caches(num_layers: int, capacity: int) -> list[LayerKVCache]:
    """One empty cache per transformer layer of a stage."""
    return [LayerKVCache(capacity) for _ in range(num_layers)]


class StaticKVCache(LayerKVCache):
    """K and V in fixed buffers, written at the shared device position (module docstring)."""

    def __init__(self, capacity: int, position: torch.Tensor):
        super().__init__(capacity)
        self.position = position

    def extend(self, key: torch.Tensor, value: torch.Tensor):
        """key, value [b, np, s, hn] of positions p .. p + s - 1 (p = position) -> the buffers
        [b, np, capacity, hn], the mask [1, 1, s, capacity] (True where key k > the query's position)
        and the positions [s]."""
        if self.keys is None:
            self.keys = torch.zeros((*key.shape[:-2], self.capacity, key.shape[-1]), dtype=key.dtype,
                                    device=key.device)
            self.values = torch.zeros_like(self.keys)
        positions = self.position + torch.arange(key.shape[-2], device=key.device)  # [s]
        self.keys.index_copy_(2, positions, key)
        self.values.index_copy_(2, positions, value)
        key_positions = torch.arange(self.capacity, device=key.device)
        mask = key_positions[None, :] > positions[:, None]  # [s, capacity]
        return self.keys, self.values, mask[None, None], positions


class StaticKVCaches(list):
    """The StaticKVCache of every layer of a stage and their shared write position (a device
    tensor set before each call); ``decode_graph`` keeps a captured decode step (forward.py)."""

    def __init__(self, num_layers: int, capacity: int, device=None):
        self.position = torch.zeros((), dtype=torch.long, device=device)
        super().__init__(StaticKVCache(capacity, self.position) for _ in range(num_layers))
        self.capacity = capacity
        self.decode_graph = None
