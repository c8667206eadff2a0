"""bench/bench_gpu_bandwidth.py: the device's peak is found by its exact name (or given), and the
benchmark measures on every device/dtype of conftest.py."""

import torch

from bench.bench_gpu_bandwidth import measure, peak_bandwidth


def test_the_peak_is_the_exact_device_names_or_the_given_one():
    assert peak_bandwidth("NVIDIA H200") == 4800
    assert peak_bandwidth("NVIDIA GH200 480GB") is None  # contains "H200", is no H200
    assert peak_bandwidth("NVIDIA GH200 480GB", 4000.0) == 4000
    assert peak_bandwidth("NVIDIA H200", 4500.0) == 4500


def test_measure_gives_both_rates(device_dtype):
    device, dtype = device_dtype
    rates = measure(torch.device(device), dtype, num_blocks=32, gathered=16, copies=4)
    assert len(rates) == 2 and all(rate > 0 for rate in rates)
