"""Gather and copy bandwidth of the paged KV layer (kvcache/paged_kv.py) against the device's.

On CUDA: a [num_blocks, 16, 8, 128] K and V cache per dtype (float16, bfloat16); `gather`
reads a random table of blocks through `index_select`, `copy_blocks` runs copy-on-write pairs.
Each figure counts the bytes the op moves, timed with CUDA events (median of the repeats):
`gather` reads each gathered K/V byte and writes it once; `copy_blocks` moves each copied block
four times, since its advanced indexing goes through a temporary (sources read, temporary
written, temporary read, destinations written), twice what a copy needs. Both are set against
two references: the device's peak memory bandwidth (`--peak-gbps`, else a small table by exact
device name) and a measured large `Tensor.copy_` (what the device really sustains). On CPU it
prints a note and the same figures for a smaller cache, against a measured copy_.

    python bench/bench_gpu_bandwidth.py [--peak-gbps GB_S]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


import torch

from kvfuzz.kvcache.paged_kv import PagedKVCache

PEAK_GB_S = {
    "NVIDIA H200": 4800.0,
    "NVIDIA H200 NVL": 4800.0,
    "NVIDIA H100 80GB HBM3": 3350.0,
    "NVIDIA H100 NVL": 3900.0,
    "NVIDIA H100 PCIe": 2000.0,
    "NVIDIA A100-SXM4-80GB": 2039.0,
    "NVIDIA A100 80GB PCIe": 1935.0,
    "NVIDIA A100-SXM4-40GB": 1555.0,
    "NVIDIA A100-PCIE-40GB": 1555.0,
    "NVIDIA L40S": 864.0,
    "NVIDIA L40": 864.0,
    "NVIDIA L4": 300.0,
    "NVIDIA A10": 600.0,
    "NVIDIA A10G": 600.0,
    "Tesla T4": 320.0,
    "Tesla V100-SXM2-16GB": 900.0,
    "Tesla V100-SXM2-32GB": 900.0,
    "Tesla V100-PCIE-16GB": 900.0,
    "Tesla V100-PCIE-32GB": 900.0,
    "NVIDIA GeForce RTX 4090": 1008.0,
}
"""Vendor peak memory bandwidth (GB/s) by exact `torch.cuda.get_device_name()`. Other names
(a GH200, whose peak depends on its memory, is no H200) get none unless `--peak-gbps` says."""

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 128
REPEATS = 20


def peak_bandwidth(name: str, given: float | None = None) -> float | None:
    """`given` (`--peak-gbps`) if set, else the table's entry for exactly `name`, if any."""
    return given if given is not None else PEAK_GB_S.get(name)


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
    """(gather GB/s, copy GB/s) for one cache, over the bytes each op moves (module doc)."""
    cache = PagedKVCache(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=g)[:gathered].to(device)
    block_bytes = 2 * cache.key_cache[0].numel() * cache.key_cache.element_size()  # K and V
    gather_s = timed(lambda: cache.gather(table, 0, gathered * BLOCK_SIZE), device)
    pairs = torch.randperm(num_blocks, generator=g)[:2 * copies].view(copies, 2).to(device)
    copy_s = timed(lambda: cache.copy_blocks(pairs), device)
    return 2 * gathered * block_bytes / gather_s / 1e9, 4 * copies * block_bytes / copy_s / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-gbps", type=float, metavar="GB_S",
                        help="the device's peak memory bandwidth (default: the table's entry "
                        "for the exact device name, if any)")
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
        sizes = dict(num_blocks=16384, gathered=8192, copies=2048)   # 1 GiB per dtype
        reference = reference_copy(device, 1 << 30)
    else:
        device, name = torch.device("cpu"), "CPU"
        sizes = dict(num_blocks=2048, gathered=1024, copies=256)      # 128 MiB per dtype
        reference = reference_copy(device, 1 << 27)
        print("note: no CUDA device (torch.cuda.is_available() is False); CPU figures follow, "
              "for comparison only")
    peak = peak_bandwidth(name, args.peak_gbps)
    peak_text = (f"{peak:.0f} GB/s peak ({'vendor' if args.peak_gbps is None else '--peak-gbps'})"
                 if peak else "no peak known (not in the table; pass --peak-gbps)")
    print(f"device: {name}; {peak_text}; measured Tensor.copy_: {reference:.0f} GB/s")
    print(f"cache: {sizes['num_blocks']} blocks x [{BLOCK_SIZE}, {KV_HEADS}, {HEAD_DIM}], K+V; "
          f"gather {sizes['gathered']} random blocks, copy {sizes['copies']} block pairs; "
          f"median of {REPEATS}")
    print("bytes counted: gather reads + writes each gathered block (2x); copy moves each "
          "copied block 4x (read into a temporary, written, read back, written to its "
          "destination: twice a copy's 2x)")
    print(f"{'dtype':10} {'op':7} {'GB/s':>8} {'of copy_':>9} {'of peak':>8}")
    for dtype in (torch.float16, torch.bfloat16):
        for op, rate in zip(("gather", "copy"), measure(device, dtype, **sizes)):
            of_peak = f"{rate / peak:8.0%}" if peak else f"{'-':>8}"
            print(f"{str(dtype).removeprefix('torch.'):10} {op:7} {rate:8.1f} "
                  f"{rate / reference:9.0%} {of_peak}")


if __name__ == "__main__":
    main()
