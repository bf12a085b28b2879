"""The key/value cache of incremental decoding.

Self-attention at step t needs the keys and values of every earlier position; they do not change
once computed (causal attention, fixed weights), so each layer keeps them and a step feeds only the
new tokens: K_{0..t} = [K_{0..t-1}; k_t], V likewise. A cache holds one layer's K and V as
[b, np, capacity, hn] buffers (np heads of this TP rank), allocated on the first call.

``extend(key, value)`` is what attention over the cache calls (decode_layers.cached_attention): it
stores the new keys and values and returns (K, V, mask, query positions) to attend over. Two kinds:

* LayerKVCache: K, V are the filled prefix [b, np, t + s, hn]; mask and positions None (the new
  queries are the last s positions: the plain bottom-right causal mask).
* StaticKVCache: K, V are the whole buffers [b, np, capacity, hn], the mask hides every key past
  each query's position, and the positions [s] place ALiBi's distances; the write position is a
  device tensor shared by the layers, and the positions and the mask are computed from it once per
  call for all layers (DecodeStep). Every decode step then has the same shapes and no host value,
  so the step can be captured once as a CUDA graph and replayed (forward.py).
"""
import torch


class CacheFullError(RuntimeError):
    """More positions than the cache was made for."""


class LayerKVCache:
    """K and V of one layer for ``capacity`` positions: ``extend`` appends and returns the filled part."""

    fixed_size = False  # StaticKVCache: buffers of fixed shape, written at a device position

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


class DecodeStep:
    """What every layer's static cache shares within one call: the write position p (a device tensor
    set before the call), the queries' positions p .. p + s - 1 [s] and the mask [1, 1, s, capacity]
    (True where key k > the query's position), computed once per call for all layers (``begin``)."""

    def __init__(self, capacity: int, device=None):
        self.capacity = capacity
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.query_positions: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def begin(self, length: int) -> None:
        """Positions and mask of a call feeding ``length`` tokens at the current position."""
        device = self.position.device
        self.query_positions = self.position + torch.arange(length, device=device)  # [s]
        key_positions = torch.arange(self.capacity, device=device)
        self.mask = (key_positions[None, :] > self.query_positions[:, None])[None, None]  # [1, 1, s, capacity]


class StaticKVCache(LayerKVCache):
    """K and V in fixed buffers, written at the shared device position (module docstring)."""

    def __init__(self, capacity: int, step: DecodeStep):
        super().__init__(capacity)
        self.step = step

    fixed_size = True

    def extend(self, key: torch.Tensor, value: torch.Tensor):
        """key, value [b, np, s, hn] of positions p .. p + s - 1 (p = position) -> the buffers
        [b, np, capacity, hn], the step's mask [1, 1, s, capacity] and positions [s]."""
        keys, values, positions = self.buffers(key)
        keys.index_copy_(2, positions, key)
        values.index_copy_(2, positions, value)
        return keys, values, self.step.mask, positions

    def buffers(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The buffers [b, np, capacity, hn] (made on the first call, shaped and typed after key
        [b, np, s, hn]) and the call's positions p .. p + s - 1 [s], for an attention that writes
        the call's keys and values itself (``fused_kernels.decode_attention``)."""
        if self.keys is None:
            self.keys = torch.zeros((*key.shape[:-2], self.capacity, key.shape[-1]), dtype=key.dtype,
                                    device=key.device)
            self.values = torch.zeros_like(self.keys)
        return self.keys, self.values, self.step.query_positions


class StaticKVCaches(list):
    """The StaticKVCache of every layer of a stage for ``batch`` rows and their shared DecodeStep
    (``position`` set before a call, ``step.begin`` at its start, inside a captured step too).
    ``decode_graph`` keeps a captured decode step (forward.py). The caches may serve call after call:
    positions past a call's prefix are masked, and every position up to it is written by that call
    before it is read."""

    def __init__(self, num_layers: int, batch: int, capacity: int, device=None):
        self.step = DecodeStep(capacity, device)
        super().__init__(StaticKVCache(capacity, self.step) for _ in range(num_layers))
        self.batch = batch
        self.capacity = capacity
        self.device = device
        self.decode_graph = None

    @property
    def position(self) -> torch.Tensor:
        """The write position of the next call (a device tensor, read inside a captured step)."""
        return self.step.position
