"""No silent copies: every object that owns buffers, slots or device memory refuses ``copy.copy``,
``copy.deepcopy`` and pickling with ``NotCopyableError`` (a ``TypeError``) naming its class; the values
``Tier`` and ``Capabilities`` copy as themselves."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import stagebuf
from stagebuf._common.sealed import Sealed

CPU = torch.device("cpu")


def _step() -> Any:
    stager = stagebuf.StepStager(device=CPU)
    step = stager.step()
    step.__enter__()
    return step


MAKERS: dict[str, Callable[[], Any]] = {
    "UvaBufferPool": lambda: stagebuf.UvaBufferPool(4, torch.int32, device=CPU),
    "UvaBackedTensor": lambda: stagebuf.UvaBackedTensor(4, torch.int32, device=CPU),
    "StagedWriteTensor": lambda: stagebuf.StagedWriteTensor((2, 4), torch.int32, device=CPU),
    "FusedStagedWriter": lambda: stagebuf.FusedStagedWriter(device=CPU),
    "StepStager": lambda: stagebuf.StepStager(device=CPU),
    "Step": _step,
    "DeviceParamTable": lambda: stagebuf.DeviceParamTable(2, {"t": torch.float32}, device=CPU),
    "ParamField": lambda: stagebuf.DeviceParamTable(2, {"t": torch.float32}, device=CPU)["t"],
    "HostBuffer": lambda: stagebuf.HostBuffer(4, torch.int32, device=CPU),
    "StagingBuffer": lambda: stagebuf.make_buffer(4, torch.int32, device=CPU),
}
HOW: dict[str, Callable[[Any], Any]] = {
    "copy.copy": copy.copy,
    "copy.deepcopy": copy.deepcopy,
    "pickling": lambda o: pickle.loads(pickle.dumps(o)),
}


def test_every_public_stateful_class_is_covered() -> None:
    public = {n for n in stagebuf.__all__ if isinstance(getattr(stagebuf, n), type)}
    sealed = {n for n in public if issubclass(getattr(stagebuf, n), Sealed)}
    tier_specific = {"UvaBuffer", "PinnedBuffer", "NonUvaBuffer"}  # need CUDA; share StagingBuffer's code
    assert sealed - {"Tier", "Capabilities"} - tier_specific == set(MAKERS)


@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("name", list(MAKERS))
def test_a_copy_is_refused_naming_the_class(name: str, how: str) -> None:
    obj = MAKERS[name]()
    cls = type(obj).__name__
    with pytest.raises(
        stagebuf.NotCopyableError, match=rf"^{how} of a {cls} is refused: .* Make a new {cls}"
    ):
        HOW[how](obj)
    assert isinstance(stagebuf.NotCopyableError("x"), TypeError)


def test_the_object_still_works_after_a_refused_copy() -> None:
    pool = stagebuf.UvaBufferPool(4, torch.int32, device=CPU)
    with pytest.raises(TypeError):
        copy.deepcopy(pool)
    np.testing.assert_array_equal(pool.copy_to_uva([7, 8]).numpy(), [7, 8])


@pytest.mark.parametrize("how", list(HOW))
def test_values_copy_as_themselves(how: str) -> None:
    caps = stagebuf.capabilities(CPU)
    assert HOW[how](stagebuf.Tier.PAGEABLE) is stagebuf.Tier.PAGEABLE
    got = HOW[how](caps)
    assert got.tier is caps.tier and got.device == caps.device
