"""DeviceParamTable: host writes reach the device on sync(), with one copy, only when something changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagebuf
from stagebuf._rings.param_table import DeviceParamTable

FIELDS = {
    "temperature": torch.float32,
    "top_k": torch.int32,
    "seed": torch.int64,
    "greedy": torch.bool,
    "penalty": torch.float16,
}


def examples(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )


def dev_values(table: DeviceParamTable) -> dict[str, np.ndarray]:
    return {name: table[name].gpu.cpu().numpy().copy() for name in table}


def host_values(table: DeviceParamTable) -> dict[str, np.ndarray]:
    return {name: table[name].np.copy() for name in table}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def copies(table: DeviceParamTable) -> int:
    return table.stats()["transfers"]


def test_fields_and_views(cpu_tier):
    t = DeviceParamTable(7, FIELDS, "cpu")
    assert {n: f.dtype for n, f in t.fields.items()} == FIELDS
    assert list(t) == list(FIELDS) and len(t) == 5 and "seed" in t
    for name in FIELDS:
        f = t.fields[name]
        assert f is t[name] and isinstance(f, stagebuf.ParamField) and f.name == name
    for name, dt in FIELDS.items():
        f = t[name]
        assert f.np.shape == (7,) and f.gpu.shape == (7,) and f.gpu.dtype == dt and f.cpu.dtype == dt
        assert f.gpu.data_ptr() % 16 == 0 and f.cpu.data_ptr() % 16 == 0
        assert not f.np.any() and not f.gpu.any()  # zero-filled on both sides
    with pytest.raises(KeyError, match="top_k"):
        t["nope"]


def test_sync_uploads_and_skips_unchanged(cpu_tier):
    t = DeviceParamTable(4, FIELDS, "cpu")
    copies_per_upload = 1 if cpu_tier is stagebuf.Tier.PAGEABLE else 0
    assert t.sync() is False  # nothing changed since construction: device already zero
    assert copies(t) == 0 and t.stats()["skipped"] == 1
    t["temperature"].np[:] = [0.5, 1.0, 0.0, 2.0]
    t["top_k"].np[2] = 40
    t["greedy"].np[1] = True
    assert_same(dev_values(t), {n: np.zeros(4, t[n].np.dtype) for n in t})  # not before sync
    assert t.sync() is True
    assert copies(t) == copies_per_upload
    assert_same(dev_values(t), host_values(t))
    for _ in range(3):
        assert t.sync() is False
    assert copies(t) == copies_per_upload and t.stats()["skipped"] == 4
    t["top_k"].np[2] = 40  # the same value again: nothing changed
    assert t.sync() is False
    t["seed"].np[3] = 2**62 + 1  # a single changed element
    assert t.sync() is True
    assert copies(t) == 2 * copies_per_upload
    assert_same(dev_values(t), host_values(t))
    assert t.sync(force=True) is True
    assert copies(t) == 3 * copies_per_upload
    s = t.stats()
    assert s["syncs"] == 8 and s["bytes"] == copies(t) * t.nbytes


def test_nan_is_a_value_like_any_other(cpu_tier):
    t = DeviceParamTable(2, {"x": torch.float32}, "cpu")
    t["x"].np[0] = np.nan
    assert t.sync() is True
    assert np.isnan(t["x"].gpu[0].item())
    t["x"].np[0] = np.nan  # same bits: unchanged
    assert t.sync() is False
    t["x"].np[0] = -0.0  # == 0.0 but a different value on the device: uploaded
    assert t.sync() is True
    assert str(t["x"].gpu[0].item()) == "-0.0"


def test_device_addresses_are_fixed(cpu_tier):
    t = DeviceParamTable(16, FIELDS, "cpu", max_concurrency=3)
    ptrs = {n: t[n].gpu.data_ptr() for n in t}
    for k in range(10):
        t["top_k"].np[k % 16] = k + 1
        t.sync()
        assert {n: t[n].gpu.data_ptr() for n in t} == ptrs
    assert_same(dev_values(t), host_values(t))


def test_host_writes_after_sync_do_not_reach_device(cpu_tier):
    t = DeviceParamTable(3, {"a": torch.int32}, "cpu")
    t["a"].np[:] = [1, 2, 3]
    t.sync()
    t["a"].np[:] = [7, 8, 9]  # after sync: the device keeps what was synced
    np.testing.assert_array_equal(t["a"].gpu.numpy(), [1, 2, 3])
    t.sync()
    np.testing.assert_array_equal(t["a"].gpu.numpy(), [7, 8, 9])


def test_zero_rows(cpu_tier):
    t = DeviceParamTable(0, {"a": torch.int32, "b": torch.float32}, "cpu")
    assert t["a"].np.shape == (0,) and t.sync() is False


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((-1, {"a": torch.int32}), ValueError),
        ((True, {"a": torch.int32}), ValueError),
        ((2.0, {"a": torch.int32}), ValueError),
        ((2, {}), ValueError),
        ((2, [("a", torch.int32)]), ValueError),
        ((2, {"": torch.int32}), ValueError),
        ((2, {3: torch.int32}), ValueError),
        ((2, {"a": torch.complex64}), TypeError),
        ((2, {"a": "nope"}), TypeError),
    ],
)
def test_bad_construction(args, exc):
    with pytest.raises(exc):
        DeviceParamTable(*args, "cpu")


@pytest.mark.parametrize("max_concurrency", [0, True, 1.5])
def test_bad_max_concurrency(max_concurrency):
    with pytest.raises(ValueError, match="max_concurrency"):
        DeviceParamTable(2, {"a": torch.int32}, "cpu", max_concurrency=max_concurrency)


def test_dtype_names_accepted():
    t = DeviceParamTable(2, {"a": "int32", "b": np.float64}, "cpu")
    assert {n: f.dtype for n, f in t.fields.items()} == {"a": torch.int32, "b": torch.float64}


def test_fields_mapping_is_read_only():
    t = DeviceParamTable(2, {"a": torch.int32}, "cpu")
    with pytest.raises(TypeError):
        t.fields["b"] = t["a"]  # type: ignore[index]
    assert list(t.fields) == ["a"]
    with pytest.raises(TypeError):
        t["a"] = [1, 2]  # type: ignore[index]


def test_device_is_optional(cpu_tier):
    t = DeviceParamTable(3, {"a": torch.int32})
    assert t.device == stagebuf.capabilities().device and t.tier is cpu_tier
    t["a"].np = [1, 2, 3]
    assert t.sync() is True
    np.testing.assert_array_equal(t["a"].gpu.cpu().numpy(), [1, 2, 3])
    t2 = DeviceParamTable(3, {"a": torch.int32}, None, 2)
    assert t2.device == t.device and t2.max_concurrency == 2


# --- assignment: .np/.cpu copy the values in; everything else raises ---------------------


def test_assigning_np_copies_and_sync_uploads(cpu_tier):
    t = DeviceParamTable(4, FIELDS, "cpu")
    model = {n: np.zeros(4, t[n].np.dtype) for n in t}
    views = {n: t[n].np for n in t}
    t["temperature"].np = np.array([0.5, 1.0, 0.0, 2.0])  # float64 values that fit float32
    model["temperature"][:] = [0.5, 1.0, 0.0, 2.0]
    t["top_k"].np = [1, 2, 3, 40]
    model["top_k"][:] = [1, 2, 3, 40]
    t["seed"].cpu = torch.tensor([2**62, -1, 0, 7])
    model["seed"][:] = [2**62, -1, 0, 7]
    t["greedy"].np = True  # a scalar: every row
    model["greedy"][:] = True
    t["penalty"].np = np.float16(1.5)
    model["penalty"][:] = 1.5
    assert all(t[n].np is views[n] for n in t)  # nothing rebinds: the same host views
    assert_same(host_values(t), model)
    assert t.sync() is True
    assert_same(dev_values(t), model)
    t["top_k"].np += 1  # in place, then assigned to itself: a copy onto itself
    model["top_k"] += 1
    assert t.sync() is True
    assert_same(dev_values(t), model)


@pytest.mark.parametrize(
    ("field", "value", "exc", "text"),
    [
        (
            "top_k",
            [1, 2, 3],
            ValueError,
            r"table\['top_k'\]\.np: a value of shape \(3,\) was given; expected shape \(4,\)",
        ),
        ("top_k", np.zeros((4, 1), np.int32), ValueError, r"table\['top_k'\]\.np has rank 2"),
        ("top_k", [1.5, 0, 0, 0], ValueError, r"table\['top_k'\]\.np holds fractional values"),
        ("top_k", [2**31, 0, 0, 0], ValueError, r"table\['top_k'\]\.np holds values in .* outside int32"),
        ("top_k", np.nan, ValueError, r"table\['top_k'\]\.np holds NaN or inf"),
        ("top_k", [True, False, True, False], TypeError, "bools and numbers are not converted"),
        (
            "temperature",
            [1e39, 0, 0, 0],
            ValueError,
            r"table\['temperature'\]\.np holds finite values beyond",
        ),
        ("temperature", "fast", TypeError, r"table\['temperature'\]\.np must be a list"),
        ("seed", torch.zeros(3, dtype=torch.int64), ValueError, r"table\['seed'\]\.np: a value of shape"),
    ],
)
def test_bad_np_assignment_raises_and_writes_nothing(cpu_tier, field, value, exc, text):
    t = DeviceParamTable(4, FIELDS, "cpu")
    t["top_k"].np[:] = [5, 6, 7, 8]
    t["temperature"].np[:] = 0.25
    before = host_values(t)
    with pytest.raises(exc, match=text):
        t[field].np = value
    assert_same(host_values(t), before)
    with pytest.raises(exc):
        t[field].cpu = value
    assert_same(host_values(t), before)
    assert t.sync() is True  # what was written before the bad call still uploads
    assert_same(dev_values(t), before)


@pytest.mark.parametrize("attr", ["gpu", "dtype", "name", "offset", "other"])
def test_other_field_attributes_are_read_only(cpu_tier, attr):
    t = DeviceParamTable(4, FIELDS, "cpu")
    f = t["top_k"]
    before = getattr(f, attr, None)
    with pytest.raises(AttributeError, match=rf"ParamField\.{attr} is read-only: "):
        setattr(f, attr, torch.ones(4, dtype=torch.int32))
    assert getattr(f, attr, None) is before
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del f.np


@pytest.mark.parametrize(
    ("attr", "text"),
    [
        ("num_rows", "make a new DeviceParamTable"),
        ("device", "make a new table"),
        ("nbytes", "fixed"),
        ("max_concurrency", "max_concurrency="),
        ("tier", "STAGEBUF_TIER"),
        ("fields", r"table\[name\]\.np"),
        ("temperature", r"fields are not attributes.*table\['temperature'\]\.np"),
        ("whatever", "fixed"),
    ],
)
def test_table_attributes_are_read_only(cpu_tier, attr, text):
    t = DeviceParamTable(4, FIELDS, "cpu")
    before = getattr(t, attr, None)
    with pytest.raises(AttributeError, match=rf"DeviceParamTable\.{attr}.*{text}"):
        setattr(t, attr, 5)
    assert getattr(t, attr, None) is before
    t["top_k"].np[:] = [1, 2, 3, 4]  # the table still works as made
    assert t.sync() is True and t["top_k"].gpu.tolist() == [1, 2, 3, 4]
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del t.num_rows


@examples(40)
@given(data=st.data())
def test_random_whole_field_assignments(cpu_tier, data):
    rows = data.draw(st.integers(0, 9))
    t = DeviceParamTable(rows, FIELDS, "cpu", max_concurrency=2)
    model = {n: np.zeros(rows, t[n].np.dtype) for n in t}
    for _ in range(data.draw(st.integers(1, 6))):
        name = data.draw(st.sampled_from(list(FIELDS)))
        dt = model[name].dtype
        if dt == np.bool_:
            vals, src = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)), np.bool_
        elif dt.kind == "f":
            vals = data.draw(st.lists(st.integers(-1000, 1000), min_size=rows, max_size=rows))
            vals, src = [v / 8 for v in vals], np.float64  # exact in float16
        else:
            vals = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=rows, max_size=rows))
            src = np.int64
        t[name].np = np.array(vals, src) if data.draw(st.booleans()) else vals
        model[name] = np.array(vals, dtype=dt)
        assert_same(host_values(t), model)
        t.sync()
        assert_same(dev_values(t), model)


@st.composite
def write_streams(draw):
    rows = draw(st.integers(1, 9))
    ops = draw(
        st.lists(
            st.one_of(
                st.tuples(
                    st.just("write"), st.sampled_from(list(FIELDS)), st.integers(0, 99), st.integers(-99, 99)
                ),
                st.tuples(st.just("sync"), st.just(""), st.just(0), st.just(0)),
            ),
            max_size=40,
        )
    )
    return rows, ops


@examples(40)
@given(stream=write_streams())
def test_random_write_sync_streams(cpu_tier, stream):
    rows, ops = stream
    t = DeviceParamTable(rows, FIELDS, "cpu", max_concurrency=2)
    model = {n: np.zeros(rows, t[n].np.dtype) for n in t}  # what the device should hold
    uploads = 0
    for kind, name, i, v in ops:
        if kind == "write":
            value = bool(v % 2) if FIELDS[name] is torch.bool else v
            t[name].np[i % rows] = value
        else:
            changed = any(not np.array_equal(model[n], t[n].np) for n in t)
            assert t.sync() is changed
            if changed:
                uploads += 1
                model = host_values(t)
        assert_same(dev_values(t), model)
    s = t.stats()
    assert s["transfers"] == (uploads if cpu_tier is stagebuf.Tier.PAGEABLE else 0)
    assert s["skipped"] == sum(1 for op in ops if op[0] == "sync") - uploads


# --- GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_sync_skips_and_uploads(gpu_tier):
    t = DeviceParamTable(256, FIELDS, "cuda")
    assert t.tier is gpu_tier and all(t[n].gpu.device.type == "cuda" for n in t)
    assert t.sync() is False and copies(t) == 0
    rng = np.random.default_rng(0)
    for k in range(20):
        t["temperature"].np[:] = rng.random(256, dtype=np.float32)
        t["top_k"].np[k] = k
        assert t.sync() is True
        assert t.sync() is False
        assert_same(dev_values(t), host_values(t))
    assert copies(t) == 20 and t.stats()["skipped"] == 21


@pytest.mark.gpu
def test_gpu_host_writes_after_sync_never_race(gpu_tier):
    """Rewrite the host right after each sync, many times: the device must hold each synced snapshot."""
    t = DeviceParamTable(1 << 16, {"a": torch.int64}, "cuda", max_concurrency=2)
    out = torch.empty((50, 1 << 16), dtype=torch.int64, device="cuda")
    for k in range(50):
        t["a"].np[:] = k + 1
        assert t.sync() is True
        out[k].copy_(t["a"].gpu)  # stream-ordered after the upload
        t["a"].np[:] = -1  # immediately after: must not reach the copy in flight
    got = out.cpu().numpy()
    for k in range(50):
        assert (got[k] == k + 1).all(), k
    assert copies(t) == 50


@pytest.mark.gpu
@examples(20)
@given(stream=write_streams())
def test_gpu_random_write_sync_streams(gpu_tier, stream):
    rows, ops = stream
    t = DeviceParamTable(rows, FIELDS, "cuda", max_concurrency=2)
    model = {n: np.zeros(rows, t[n].np.dtype) for n in t}
    for kind, name, i, v in ops:
        if kind == "write":
            t[name].np[i % rows] = bool(v % 2) if FIELDS[name] is torch.bool else v
        else:
            changed = any(not np.array_equal(model[n], t[n].np) for n in t)
            assert t.sync() is changed
            if changed:
                model = host_values(t)
        assert_same(dev_values(t), model)
