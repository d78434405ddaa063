"""A batch KV cache that sequences join and leave between decode steps.

Rows are right-aligned: every row's tokens end at the same column, so one decode step appends
one column for all rows. A row's valid region is its last `lengths[r]` columns; the rest is
zero padding masked out by the attention mask. Buffers are preallocated along time and written
in place (transformers' DynamicCache concatenates, copying the whole cache every step). A row that
leaves frees its slot (length 0, every column masked); rows that join are placed in free slots
(`place`, copying only their own K/V) or appended (`extend`); `keep` compacts.

Layers that keep a fixed-size state per row instead of keys and values (Qwen3.5's linear attention,
LFM2's short convolutions) hold it in transformers' own LinearAttentionLayer, whose [rows, ...]
tensors follow the same row operations. A state cannot be cut back to a prefix: a batch with
states starts from a prefix's keys only with the states after that whole prefix.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer, LinearAttentionLayer

from server.engine.prefix_cache import RowState

HEADROOM = 64  # columns allocated past a batch's width when it is built, grown or joined: decode steps to come


class SlabLayer(DynamicLayer):
    """One layer's K/V in a preallocated [B, H, capacity, D] buffer; `update` writes in place."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int):
        super().__init__()
        self.kbuf, self.vbuf, self.length = kbuf, vbuf, length
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self.is_initialized = True
        self.keys, self.values = kbuf[:, :, :length], vbuf[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        end = self.length + q
        self.kbuf[:, :, self.length:end] = key_states
        self.vbuf[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self.kbuf[:, :, :end], self.vbuf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def _state_tensors(layer: LinearAttentionLayer) -> list[tuple[dict, int]]:
    """Where a state layer keeps its [rows, ...] tensors: (the dict, the key) of each one it holds."""
    return [(states, i) for states, ready in ((layer.conv_states, layer.is_conv_states_initialized),
                                              (layer.recurrent_states, layer.is_recurrent_states_initialized))
            for i in states if ready[i]]


def _start_state(layer: LinearAttentionLayer, conv: dict[int, torch.Tensor], recurrent: dict[int, torch.Tensor],
                 rows: int) -> None:
    """`layer` holding, in each of `rows` rows, a state a forward left after a prefix: as transformers'
    own update leaves it, so that the next forward continues from it."""
    for states, ready, saved in ((layer.conv_states, layer.is_conv_states_initialized, conv),
                                 (layer.recurrent_states, layer.is_recurrent_states_initialized, recurrent)):
        for i, t in saved.items():
            states[i], ready[i], layer.has_previous_state[i] = t.expand(rows, *t.shape).clone(), True, True
            layer.dtype, layer.device = t.dtype, t.device
    layer.conv_kernel_size.update({i: t.shape[-1] for i, t in conv.items()})


class BatchKV:
    """K/V for all running rows plus each row's valid length; `states`, in model order, the layers
    that keep a state instead, and `kinds` what each layer caches ("kv", "state" or "none")."""

    def __init__(self, kbufs: list[torch.Tensor], vbufs: list[torch.Tensor], width: int, lengths: list[int],
                 states: list[LinearAttentionLayer] | None = None, kinds: tuple[str, ...] = ()):
        self.kbufs, self.vbufs = kbufs, vbufs
        self.width = width  # columns in use (== max over rows of padding + length)
        self.lengths = lengths
        self.states, self.kinds = states or [], kinds

    @classmethod
    def empty(cls, n_layers: int, rows: int, heads: int, head_dim: int, capacity: int, dtype, device,
              values: tuple[int, int] | None = None, kinds: tuple[str, ...] = ()) -> "BatchKV":
        """`values`: heads and size of the values where they are not the keys' (multi-head latent attention).
        `kinds`: each layer's cache where some keep a state (the states take their shapes in the first forward)."""
        value_heads, value_dim = values or (heads, head_dim)
        return cls(
            [torch.zeros((rows, heads, capacity, head_dim), dtype=dtype, device=device) for _ in range(n_layers)],
            [torch.zeros((rows, value_heads, capacity, value_dim), dtype=dtype, device=device)
             for _ in range(n_layers)],
            0,
            [0] * rows,
            [LinearAttentionLayer() for kind in kinds if kind == "state"],
            kinds,
        )

    def write_prefix(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int,
                     states: list[RowState] | None = None) -> None:
        """Start every row (of an empty batch) with the same first `length` tokens' K/V, per layer
        [heads, >= length, head_dim], and where layers keep states, with their states after those
        `length` tokens exactly."""
        if self.states and (states is None or len(states) != len(self.states)):
            raise ValueError("a batch whose layers keep states starts from a prefix only with its states")
        for layer, (conv, recurrent) in zip(self.states, states or ()):
            _start_state(layer, conv, recurrent, self.rows)
        for kbuf, vbuf, k, v in zip(self.kbufs, self.vbufs, keys, values):
            kbuf[:, :, :length] = k[:, :length]
            vbuf[:, :, :length] = v[:, :length]
        self.width, self.lengths = length, [length] * self.rows

    def fill(self, width: int, lengths: list[int]) -> None:
        """Record that a forward wrote `width` columns of left-padded rows of `lengths`, and zero
        each row's padding: what the model computed there is masked out, but need not be finite."""
        cols = torch.arange(width, device=self.kbufs[0].device)
        pad = cols[None, :] < torch.tensor([width - n for n in lengths], device=cols.device)[:, None]
        for buf in (*self.kbufs, *self.vbufs):
            buf[:, :, :width].masked_fill_(pad[:, None, :, None], 0)  # not a product: NaN * 0 is NaN
        self.width, self.lengths = width, list(lengths)

    def row_states(self, row: int) -> list[RowState]:
        """A copy of `row`'s state in every layer that keeps one (for the prefix cache)."""
        def copy(states: dict, ready: dict) -> dict[int, torch.Tensor]:
            return {i: t[row].clone() for i, t in states.items() if ready[i]}

        return [(copy(layer.conv_states, layer.is_conv_states_initialized),
                 copy(layer.recurrent_states, layer.is_recurrent_states_initialized)) for layer in self.states]

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        states = [d[i] for layer in self.states for d, i in _state_tensors(layer)]
        return sum(b.nelement() * b.element_size() for b in (*self.kbufs, *self.vbufs, *states))

    @property
    def capacity(self) -> int:
        return self.kbufs[0].shape[2] if self.kbufs else 0

    def cache(self) -> Cache:
        """A transformers Cache view over the buffers; forward passes write through it."""
        slabs = [SlabLayer(k, v, self.width) for k, v in zip(self.kbufs, self.vbufs)]
        if not self.kinds:
            return Cache(layers=slabs)
        for layer in self.states:  # what a state layer reports as the sequence's length
            layer.cumulative_length_linear = torch.tensor(self.width, device=self.kbufs[0].device)
        slab, state = iter(slabs), iter(self.states)
        return Cache(layers=[next(slab) if kind == "kv" else next(state) if kind == "state" else DummyLayer()
                             for kind in self.kinds])

    def advance(self, columns: int) -> None:
        """Record that a forward pass appended `columns` to every row."""
        self.width += columns
        self.lengths = [n + columns for n in self.lengths]

    def ensure_capacity(self, extra: int) -> None:
        need = self.width + extra
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity, HEADROOM)
        self.kbufs = [_regrow(b, new_cap, 0, self.width) for b in self.kbufs]
        self.vbufs = [_regrow(b, new_cap, 0, self.width) for b in self.vbufs]

    def attention_mask(self, extra: int = 0) -> torch.Tensor:
        """[rows, width + extra] with 1 on each row's valid columns (and the `extra` new ones)."""
        total = self.width + extra
        cols = torch.arange(total, device=self.kbufs[0].device)
        starts = torch.tensor([self.width - n for n in self.lengths], device=cols.device)
        return (cols[None, :] >= starts[:, None]).long()

    def extend(self, other: "BatchKV") -> None:
        """Append `other`'s rows, right-aligning both to the wider of the two."""
        width = max(self.width, other.width)
        cap = max(width + HEADROOM, self.capacity, other.capacity)
        self.kbufs = [_stack(a, self.width, b, other.width, width, cap) for a, b in zip(self.kbufs, other.kbufs)]
        self.vbufs = [_stack(a, self.width, b, other.width, width, cap) for a, b in zip(self.vbufs, other.vbufs)]
        self.width = width
        self.lengths = self.lengths + other.lengths
        for mine, theirs in zip(self.states, other.states):
            for (states, i), (new, _) in zip(_state_tensors(mine), _state_tensors(theirs)):
                states[i] = torch.cat([states[i], new[i]])

    def free(self, rows: list[int]) -> None:
        """Rows whose slots hold nothing any more: their columns are masked out from now on."""
        for r in rows:
            self.lengths[r] = 0

    def place(self, slots: list[int], other: "BatchKV") -> None:
        """Put `other`'s rows in free `slots` (other.width <= width), right-aligned with the rest.
        The columns left of them are zeroed: a former row's K/V there is masked out, but need not
        be finite (a row that failed on non-finite logits)."""
        offset = self.width - other.width
        index = torch.tensor(slots, dtype=torch.long, device=self.kbufs[0].device)
        for buf, new in zip((*self.kbufs, *self.vbufs), (*other.kbufs, *other.vbufs)):
            buf[:, :, :offset].index_fill_(0, index, 0)
            buf[:, :, offset:self.width].index_copy_(0, index, new[:, :, :other.width])
        for slot, n in zip(slots, other.lengths):
            self.lengths[slot] = n
        for mine, theirs in zip(self.states, other.states):
            for (states, i), (new, _) in zip(_state_tensors(mine), _state_tensors(theirs)):
                states[i].index_copy_(0, index, new[i])

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order) and drop columns that are padding for all of them."""
        lengths = [self.lengths[r] for r in rows]
        new_width = max(lengths, default=0)
        start = self.width - new_width
        index = torch.tensor(rows, dtype=torch.long, device=self.kbufs[0].device)
        cap = new_width + HEADROOM
        self.kbufs = [_regrow(b.index_select(0, index), cap, start, self.width) for b in self.kbufs]
        self.vbufs = [_regrow(b.index_select(0, index), cap, start, self.width) for b in self.vbufs]
        self.width, self.lengths = new_width, lengths
        for layer in self.states:
            for states, i in _state_tensors(layer):
                states[i] = states[i].index_select(0, index)


def _regrow(buf: torch.Tensor, capacity: int, start: int, end: int) -> torch.Tensor:
    """Copy columns [start, end) of `buf` to the front of a new buffer of `capacity` columns."""
    out = buf.new_zeros(buf.shape[0], buf.shape[1], capacity, buf.shape[3])
    out[:, :, : end - start] = buf[:, :, start:end]
    return out


def _stack(a: torch.Tensor, wa: int, b: torch.Tensor, wb: int, width: int, cap: int) -> torch.Tensor:
    out = a.new_zeros(a.shape[0] + b.shape[0], a.shape[1], cap, a.shape[3])
    out[: a.shape[0], :, width - wa:width] = a[:, :, :wa]
    out[a.shape[0]:, :, width - wb:width] = b[:, :, :wb]
    return out
