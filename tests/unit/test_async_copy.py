"""async_copy_to_gpu: any host input to the device, never aliasing it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stagebuf import async_copy_to_gpu, capabilities


@pytest.mark.parametrize("kind", ["list", "ndarray", "tensor"])
def test_inputs_arrive_and_do_not_alias(any_tier, kind):
    data = np.arange(12, dtype=np.int32).reshape(3, 4)
    x = {"list": data.tolist(), "ndarray": data.copy(), "tensor": torch.from_numpy(data.copy())}[kind]
    out = async_copy_to_gpu(x, dtype=torch.int32)
    if isinstance(x, np.ndarray):
        x[:] = -1
    elif isinstance(x, torch.Tensor):
        x.fill_(-1)
    assert out.device == capabilities().device
    np.testing.assert_array_equal(out.cpu().numpy(), data)


def test_out_is_filled(any_tier):
    dev = capabilities().device
    out = torch.zeros(5, dtype=torch.float32, device=dev)
    res = async_copy_to_gpu(np.linspace(0, 1, 5, dtype=np.float32), out=out)
    assert res.data_ptr() == out.data_ptr()
    np.testing.assert_allclose(out.cpu().numpy(), np.linspace(0, 1, 5, dtype=np.float32))


def test_out_with_wrong_shape_is_refused(any_tier):
    out = torch.zeros(4, dtype=torch.float32, device=capabilities().device)
    with pytest.raises(ValueError, match=r"out has shape \(4,\)"):
        async_copy_to_gpu([1.0, 2.0, 3.0], out=out)


@pytest.mark.parametrize(
    "x, err, msg",
    [
        (None, TypeError, "x must be"),
        ([1.5, 2.0], ValueError, "fractional"),
        ([1, "a"], TypeError, "mixed or non-numeric"),
        ([float("inf")], ValueError, "NaN or inf"),
    ],
)
def test_bad_inputs(x, err, msg):
    with pytest.raises(err, match=msg):
        async_copy_to_gpu(x, dtype=torch.int32)
