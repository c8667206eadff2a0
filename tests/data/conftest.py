"""The device/dtype every data test runs on: CPU float32 and float64 always; CUDA float16 and bfloat16 under
the `gpu` marker, skipped with a reason where CUDA is absent (`pytest -m gpu` selects them)."""

import pytest
import torch

_NO_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available (torch.cuda.is_available() is "
    "False)"
)

LAYOUTS = [
    pytest.param(("cpu", torch.float32), id="cpu-float32"),
    pytest.param(("cpu", torch.float64), id="cpu-float64"),
    pytest.param(("cuda", torch.float16), id="cuda-float16", marks=[pytest.mark.gpu, _NO_CUDA]),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bfloat16", marks=[pytest.mark.gpu, _NO_CUDA]),
]


@pytest.fixture(params=LAYOUTS)
def device_dtype(request: pytest.FixtureRequest) -> tuple[str, torch.dtype]:
    """(device, dtype) of the paged KV tensors under test."""
    return request.param
