"""Paged KV tensors: the memory block tables address (torch; not imported by `import kvcache`).

One `PagedKVCache` holds the keys and values of one KV-cache group as two tensors of shape
[num_blocks, block_size, num_kv_heads, head_dim], on any torch device and dtype. Token position
p of a request lives at block `table[p // block_size]`, offset `p % block_size`; every operation
maps positions to flat slots (`block * block_size + offset`) with index arithmetic and moves the
data with one `index_copy_` / `index_select` / advanced-indexing call, never a loop per token.

`attention` is paged attention for one query step (gather through the table, then softmax
attention accumulated in float32, or in float64 for float64 data: `accumulation_dtype`);
`dense_attention` is the reference over contiguous K/V, accumulated in float64. The two agree
within `tolerance(dtype)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BlockTable = Sequence[int] | torch.Tensor

_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) within which paged and dense attention agree in `dtype`."""
    try:
        return _TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no attention tolerance for dtype {dtype}") from None


def slot_mapping(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slot of each position through a block table (block id * block_size + offset)."""
    return table[positions // block_size] * block_size + positions % block_size


class PagedKVCache:
    """Keys and values of one group, addressed by block id and offset."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.key_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.value_cache = torch.zeros(shape, device=device, dtype=dtype)
        self._keys = self.key_cache.view(-1, num_kv_heads, head_dim)
        self._values = self.value_cache.view(-1, num_kv_heads, head_dim)

    @property
    def device(self) -> torch.device:
        return self.key_cache.device

    @property
    def dtype(self) -> torch.dtype:
        return self.key_cache.dtype

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    def slots(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """Flat slots of positions start..end-1 through `table`.

        Raises IndexError when the table does not reach position end-1 or (a table given as
        a sequence) names a block out of range; a tensor table is trusted, so the check costs
        no device synchronisation.
        """
        if not isinstance(table, torch.Tensor):
            if table and not 0 <= min(table) <= max(table) < self.num_blocks:
                raise IndexError(
                    f"block table {list(table)} names a block outside 0..{self.num_blocks - 1}"
                )
            table = torch.tensor(table, dtype=torch.long, device=self.device)
        if end > table.numel() * self.block_size:
            raise IndexError(
                f"a table of {table.numel()} blocks of {self.block_size} does not reach "
                f"position {end - 1}"
            )
        positions = torch.arange(start, end, device=self.device)
        return slot_mapping(table, positions, self.block_size)

    def write(self, table: BlockTable, start: int, key: torch.Tensor,
              value: torch.Tensor) -> torch.Tensor:
        """Store K/V [n, num_kv_heads, head_dim] of positions start..start+n-1; returns the
        slots written."""
        slots = self.slots(table, start, start + key.shape[0])
        self._keys.index_copy_(0, slots, key.to(self.device, self.dtype))
        self._values.index_copy_(0, slots, value.to(self.device, self.dtype))
        return slots

    def copy_blocks(self, pairs: Sequence[tuple[int, int]] | torch.Tensor) -> None:
        """Execute copy-on-write copies (src, dst), given as pairs or a [k, 2] tensor: every
        destination block gets its source's content (all sources are read before any
        destination is written)."""
        if len(pairs) == 0:
            return
        src, dst = torch.as_tensor(pairs, dtype=torch.long, device=self.device).unbind(1)
        self.key_cache[dst] = self.key_cache[src]
        self.value_cache[dst] = self.value_cache[src]

    def gather(self, table: BlockTable, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [end-start, num_kv_heads, head_dim] of positions start..end-1."""
        slots = self.slots(table, start, end)
        return self._keys.index_select(0, slots), self._values.index_select(0, slots)

    def attention(self, query: torch.Tensor, table: BlockTable, start: int, end: int,
                  scale: float | None = None) -> torch.Tensor:
        """Paged attention of one query [num_heads, head_dim] over positions start..end-1."""
        key, value = self.gather(table, start, end)
        return _attention(query, key, value, scale, accumulation_dtype(key.dtype))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What paged attention accumulates `dtype` data in: float32 for half precision and float32
    (as attention kernels do), the data's own dtype when it is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def _query_groups(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[num_heads, d] -> [kv_heads, heads per KV head, d] (grouped-query attention)."""
    num_heads, head_dim = query.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    return query.view(num_kv_heads, num_heads // num_kv_heads, head_dim)


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float | None, compute: torch.dtype) -> torch.Tensor:
    """Softmax attention computed in `compute`, returned in the query's dtype.

    Written with matmuls and an explicit stable softmax: on CPU, `Tensor.softmax` and
    `scaled_dot_product_attention` enter the intra-op thread pool even for a handful of
    elements, which costs milliseconds per call once its threads have gone idle.
    """
    num_heads, head_dim = query.shape
    scale = head_dim ** -0.5 if scale is None else scale
    grouped = _query_groups(query.to(compute), key.shape[1])
    scores = grouped @ key.to(compute).permute(1, 2, 0) * scale
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    out = (weights / weights.sum(dim=-1, keepdim=True)) @ value.to(compute).transpose(0, 1)
    return out.reshape(num_heads, head_dim).to(query.dtype)


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """Reference attention of one query [num_heads, d] over contiguous K/V [n, kv_heads, d],
    computed in float64."""
    return _attention(query, key, value, scale, torch.float64)
