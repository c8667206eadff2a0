"""Gather and copy bandwidth of the paged KV layer (kvcache/paged_kv.py) against the device's.

On CUDA: a [num_blocks, 16, 8, 128] K and V cache per dtype (float16, bfloat16); `gather`
reads a random table of blocks through `index_select`, `copy_blocks` runs copy-on-write pairs.
Each figure counts the bytes read plus the bytes written, timed with CUDA events (median of the
repeats), and is set against two references: the device's peak memory bandwidth from a small
table by device name, and a measured large `Tensor.copy_` (what the device really sustains).
On CPU it prints a note and the same figures for a smaller cache, against a measured copy_.

    python bench/bench_gpu_bandwidth.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvcache.paged_kv import PagedKVCache  # noqa: E402

PEAK_GB_S = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "A10": 600.0,
    "T4": 320.0,
    "V100": 900.0,
    "RTX 4090": 1008.0,
}
"""Vendor peak memory bandwidth (GB/s); the first key contained in the device name wins."""

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 128
REPEATS = 20


def peak_bandwidth(name: str) -> float | None:
    return next((gb for key, gb in PEAK_GB_S.items() if key in name), None)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of one call (CUDA events on a GPU, perf_counter on CPU)."""
    fn()
    samples = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def reference_copy(device: torch.device, num_bytes: int) -> float:
    """GB/s of one large `Tensor.copy_` (bytes read + bytes written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timed(lambda: dst.copy_(src), device) / 1e9


def measure(device: torch.device, dtype: torch.dtype, num_blocks: int, gathered: int,
            copies: int) -> tuple[float, float]:
    """(gather GB/s, copy GB/s) for one cache."""
    cache = PagedKVCache(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=g)[:gathered].to(device)
    block_bytes = 2 * cache.key_cache[0].numel() * cache.key_cache.element_size()  # K and V
    gather_s = timed(lambda: cache.gather(table, 0, gathered * BLOCK_SIZE), device)
    pairs = torch.randperm(num_blocks, generator=g)[:2 * copies].view(copies, 2).to(device)
    copy_s = timed(lambda: cache.copy_blocks(pairs), device)
    return 2 * gathered * block_bytes / gather_s / 1e9, 2 * copies * block_bytes / copy_s / 1e9


def main() -> None:
    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
        sizes = dict(num_blocks=16384, gathered=8192, copies=2048)   # 1 GiB per dtype
        reference = reference_copy(device, 1 << 30)
        peak = peak_bandwidth(name)
    else:
        device, name = torch.device("cpu"), "CPU"
        sizes = dict(num_blocks=2048, gathered=1024, copies=256)      # 128 MiB per dtype
        reference, peak = reference_copy(device, 1 << 27), None
        print("note: no CUDA device (torch.cuda.is_available() is False); CPU figures follow, "
              "for comparison only")
    peak_text = f"{peak:.0f} GB/s vendor peak" if peak else "no vendor peak in the table"
    print(f"device: {name}; {peak_text}; measured Tensor.copy_: {reference:.0f} GB/s")
    print(f"cache: {sizes['num_blocks']} blocks x [{BLOCK_SIZE}, {KV_HEADS}, {HEAD_DIM}], K+V; "
          f"gather {sizes['gathered']} random blocks, copy {sizes['copies']} block pairs; "
          f"median of {REPEATS}, bytes read + written")
    print(f"{'dtype':10} {'op':7} {'GB/s':>8} {'of copy_':>9} {'of peak':>8}")
    for dtype in (torch.float16, torch.bfloat16):
        for op, rate in zip(("gather", "copy"), measure(device, dtype, **sizes)):
            of_peak = f"{rate / peak:8.0%}" if peak else f"{'-':>8}"
            print(f"{str(dtype).removeprefix('torch.'):10} {op:7} {rate:8.1f} "
                  f"{rate / reference:9.0%} {of_peak}")


if __name__ == "__main__":
    main()
