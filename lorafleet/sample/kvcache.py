"""A KV cache of fixed batch rows, each row holding one sequence at its own length.

HF's `DynamicCache` assumes every row of the batch has the same length and grows by
concatenation (a full copy per step). Continuous batching needs the opposite: rows at different
lengths decoding together, rows freed and refilled mid-run. So each layer keeps
`keys/values[rows, kv_heads, capacity, head_dim]`; a forward names a contiguous range of rows,
each row's start column and the number of new tokens `q`, and:

- `update` writes the new keys/values at columns start..start+q-1 of each row (a slice when all
  starts are equal, as in a prefill; one indexed write when q == 1, as in a decode step; a write
  per row for a prefill of rows that resume after cached prefixes, prefix_cache.py) and
  hands attention a view of columns [0, max start + q) of those rows: no copy of the cache;
- the mask lets query t of row i see columns j <= start_i + t, which is causal for a prefill,
  full history for a decode step, and hides whatever a row holds beyond its own length (padding
  or a previous occupant's keys), so rows never need clearing.

RoPE is applied before keys are cached and positions are passed explicitly per row, so where a
key sits in its row only matters through the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True)
class ForwardPlan:
    """What the next forward over the cache covers; built by `RowCache.plan`."""

    rows: slice
    starts: torch.Tensor  # int64 [n], column of each row's first new token
    q: int
    uniform_start: int | None  # the common start when all rows share it
    kv_len: int
    starts_list: list[int]


class _RowLayer(CacheLayerMixin):
    """One decoder layer's slice of the row cache (delegates to its owner)."""

    is_compileable = False
    is_croppable = False
    device: torch.device  # set with the buffers (HF code reads it)

    def __init__(self, owner: RowCache, index: int):
        super().__init__()
        self.owner = owner
        self.index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner._allocate_layer(self, key_states, value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._write(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("RowCache forwards take an explicit 4-D mask from RowCache.plan")

    def get_seq_length(self) -> int:
        plan = self.owner.current
        return 0 if plan is None else plan.kv_len - plan.q

    def get_max_length(self) -> int:
        return self.owner.capacity


class RowCache(Cache):
    """KV storage for `num_rows` independent sequences (see module docstring)."""

    def __init__(self, num_layers: int, num_rows: int, *, initial_capacity: int = 64):
        super().__init__(layers=[])
        self.layers = [_RowLayer(self, i) for i in range(num_layers)]
        self.num_rows = num_rows
        self.capacity = initial_capacity
        self.current: ForwardPlan | None = None

    def _row_layers(self) -> list[_RowLayer]:
        """`self.layers` as what it holds: every layer is a `_RowLayer` built above."""
        return [layer for layer in self.layers if isinstance(layer, _RowLayer)]

    # ------------------------------------------------------------------ layout
    def _allocate_layer(
        self, layer: _RowLayer, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        _, heads, _, k_dim = key_states.shape
        v_dim = value_states.shape[-1]
        layer.keys = key_states.new_zeros(self.num_rows, heads, self.capacity, k_dim)
        layer.values = value_states.new_zeros(self.num_rows, heads, self.capacity, v_dim)
        layer.device = key_states.device
        layer.is_initialized = True

    def reserve(self, columns: int) -> None:
        """Ensures every row can hold `columns` positions (grows by doubling, keeps contents)."""
        if columns <= self.capacity:
            return
        new_capacity = max(columns, 2 * self.capacity)
        for layer in self._row_layers():
            if not layer.is_initialized:
                continue
            for name in ("keys", "values"):
                old = getattr(layer, name)
                grown = old.new_zeros(old.shape[0], old.shape[1], new_capacity, old.shape[3])
                grown[:, :, : self.capacity] = old
                setattr(layer, name, grown)
        self.capacity = new_capacity

    def release(self) -> None:
        """Frees the buffers (e.g. between sampling phases); they are re-allocated on demand."""
        for layer in self._row_layers():
            layer.keys = layer.values = None
            layer.is_initialized = False
        self.current = None

    # ------------------------------------------------------------------ forwards
    def plan(
        self, rows: slice, starts: torch.Tensor, q: int, *, dtype: torch.dtype, additive: bool
    ) -> tuple[ForwardPlan, torch.Tensor, torch.Tensor]:
        """Sets up the next forward: returns (plan, 4-D attention mask, position_ids [n, q]).

        `additive` gives a float mask (0 / -inf style) for eager attention; otherwise a bool
        mask (True = attend), which is what SDPA takes.
        """
        n = rows.stop - rows.start
        if starts.shape != (n,):
            raise ValueError(f"starts has shape {tuple(starts.shape)}, expected ({n},)")
        if q < 1:
            raise ValueError(f"q must be >= 1, got {q}")
        starts_list = starts.tolist()
        uniform = starts_list[0] if all(s == starts_list[0] for s in starts_list) else None
        kv_len = max(starts_list) + q
        self.reserve(kv_len)
        device = starts.device
        steps = torch.arange(q, device=device)
        positions = starts.unsqueeze(1) + steps.unsqueeze(0)  # [n, q]
        columns = torch.arange(kv_len, device=device)
        allowed = columns.view(1, 1, kv_len) <= positions.unsqueeze(2)  # [n, q, kv]
        mask = allowed.unsqueeze(1)
        if additive:
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        plan = ForwardPlan(
            rows=rows,
            starts=starts,
            q=q,
            uniform_start=uniform,
            kv_len=kv_len,
            starts_list=starts_list,
        )
        self.current = plan
        return plan, mask, positions

    def _write(
        self, layer: _RowLayer, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.current
        if plan is None:
            raise RuntimeError("RowCache used without a plan; call plan() before the forward")
        rows = plan.rows
        assert layer.keys is not None and layer.values is not None  # allocated before the write
        if plan.uniform_start is not None:
            start = plan.uniform_start
            layer.keys[rows, :, start : start + plan.q] = key_states
            layer.values[rows, :, start : start + plan.q] = value_states
        elif plan.q > 1:  # a prefill of rows resuming after cached prefixes of different lengths
            for i, start in enumerate(plan.starts_list):
                row = rows.start + i
                layer.keys[row, :, start : start + plan.q] = key_states[i]
                layer.values[row, :, start : start + plan.q] = value_states[i]
        else:
            index = torch.arange(rows.stop - rows.start, device=key_states.device)
            layer.keys[rows][index, :, plan.starts] = key_states[:, :, 0]
            layer.values[rows][index, :, plan.starts] = value_states[:, :, 0]
        return layer.keys[rows, :, : plan.kv_len], layer.values[rows, :, : plan.kv_len]

    def finish(self) -> None:
        self.current = None

    # ------------------------------------------------------------------ prefix blocks
    def read_span(self, row: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys and values at positions [start, stop), stacked over layers:
        [layers, kv_heads, stop - start, head_dim] each (views; the prefix cache clones them)."""
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for layer in self._row_layers():
            if layer.keys is None or layer.values is None:
                raise RuntimeError("read_span: the row cache holds no buffers")
            keys.append(layer.keys[row, :, start:stop])
            values.append(layer.values[row, :, start:stop])
        return torch.stack(keys), torch.stack(values)

    def write_span(self, row: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row `row` takes `keys`/`values` ([layers, kv_heads, n, head_dim], as `read_span`
        gives) at positions [start, start + n); allocates the buffers if they were released."""
        n = keys.shape[2]
        layers = self._row_layers()
        if keys.shape[0] != len(layers) or values.shape[0] != len(layers):
            raise ValueError(
                f"write_span: got KV for {keys.shape[0]} layers, the cache has {len(layers)}"
            )
        self.reserve(start + n)
        for index, layer in enumerate(layers):
            if not layer.is_initialized:
                self._allocate_layer(layer, keys[index : index + 1], values[index : index + 1])
            assert layer.keys is not None and layer.values is not None
            layer.keys[row, :, start : start + n] = keys[index]
            layer.values[row, :, start : start + n] = values[index]

    # ------------------------------------------------------------------ row moves
    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row dst takes row src's first `length` positions (fan-out of a shared prompt, or
        compaction when a sequence leaves)."""
        if src == dst or length == 0:
            return
        for layer in self._row_layers():
            if layer.keys is not None and layer.values is not None:
                layer.keys[dst, :, :length] = layer.keys[src, :, :length]
                layer.values[dst, :, :length] = layer.values[src, :, :length]
