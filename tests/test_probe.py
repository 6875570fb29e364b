"""Probe unit tests on hand-made tensors (no engines)."""

from __future__ import annotations

import math
import struct

import torch
from torch import nn

from workbench.rank.poison import poison_, poisoned
from workbench.rank.probe import COLUMNS, probe_module, probe_tensors


def one(t: torch.Tensor, name: str = "t") -> dict:
    return probe_tensors([(name, "tensor", t)], rank=3)[0]


def test_rows_have_the_shared_vocabulary():
    row = one(torch.arange(4.0))
    assert list(row) == COLUMNS
    assert row["rank"] == 3 and row["numel"] == 4 and row["shape"] == "4"


def test_meta_tensor_reported_without_data():
    row = one(torch.empty(3, 5, device="meta"))
    assert row["is_meta"] is True and row["device"] == "meta"
    assert row["nan"] is None and row["head"] == [] and row["fingerprint"] == "meta"
    assert row["shape"] == "3x5"


def test_nan_inf_counts_and_finite_stats():
    t = torch.tensor([1.0, float("nan"), 3.0, float("inf"), -2.0])
    row = one(t)
    assert row["nan"] == 1 and row["inf"] == 1
    assert row["min"] == -2.0 and row["max"] == 3.0
    assert math.isclose(row["mean"], 2.0 / 3.0, rel_tol=1e-6)
    assert math.isnan(row["head"][1])


def test_bf16_head_and_dtype():
    row = one(torch.tensor([1.0, 0.5, -0.25], dtype=torch.bfloat16))
    assert row["dtype"] == "bfloat16" and row["head"] == [1.0, 0.5, -0.25]
    assert row["raw"] == torch.tensor([1.0, 0.5, -0.25], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes().hex()


def test_fingerprint_equal_for_equal_bytes_and_position_sensitive():
    a = torch.randn(1000)
    assert one(a)["fingerprint"] == one(a.clone())["fingerprint"]
    assert one(a)["fingerprint"] != one(a.roll(1))["fingerprint"]
    b = a.clone()
    b[500] = b[500] + 1
    assert one(a)["fingerprint"] != one(b)["fingerprint"]
    # the same values in another dtype are other bytes
    assert one(a)["fingerprint"] != one(a.double())["fingerprint"]


def test_kinds_tell_persistent_and_non_persistent_buffers_apart():
    m = nn.Linear(2, 2)
    m.register_buffer("kept", torch.zeros(2))
    m.register_buffer("scratch", torch.ones(2), persistent=False)
    kinds = {r["name"]: r["kind"] for r in probe_module(m, rank=0)}
    assert kinds == {"weight": "parameter", "bias": "parameter", "kept": "buffer", "scratch": "non-persistent buffer"}


def test_poisoned_to_empty_is_counted_as_never_written():
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    with poisoned(True):
        m.to_empty(device="cpu")
    rows = {r["name"]: r for r in probe_module(m, rank=0)}
    assert rows["weight"]["poisoned"] == 16 and rows["weight"]["nan"] == 16
    with torch.no_grad():
        m.weight[0].fill_(1.0)
    assert one(m.weight)["poisoned"] == 12
    # arithmetic quiets the signalling NaN: a computed NaN is not poison
    assert one(m.weight * 1.0)["poisoned"] == 0


def test_to_empty_is_left_alone_when_poison_is_off(monkeypatch):
    """Off, ``to_empty``'s hook only tracks: it writes nothing. Asked of the writes, not of the bytes: the allocator
    may hand out memory an earlier test poisoned and freed (a probe of it then counts poison the hook never wrote,
    which failed this test under ``pytest -n 2``'s default order). On, the same hook writes both tensors."""
    from workbench.rank import poison

    writes: list[int] = []
    real = poison.poison_
    monkeypatch.setattr(poison, "poison_", lambda t: writes.append(t.numel()) or real(t))
    for on, want in ((False, []), (True, [16, 4])):
        writes.clear()
        with torch.device("meta"):
            m = nn.Linear(4, 4)
        with poisoned(on):
            m.to_empty(device="cpu")
        assert sorted(writes, reverse=True) == want, (on, writes)
        assert poison._TRACKED[m.weight.data_ptr()][0] is on  # tracked either way, as poisoned only when on
    assert one(m.weight)["poisoned"] == 16


def test_poison_fills_integers_with_a_sentinel():
    t = torch.zeros(3, dtype=torch.int32)
    poison_(t)
    assert t.tolist() == [torch.iinfo(torch.int32).max] * 3


def test_rows_stay_small_for_a_large_tensor():
    import json

    row = one(torch.randn(1_000_000))
    assert len(json.dumps(row, default=str)) < 1024


def test_windows_of_many_tensors_in_one_copy_are_the_bytes_at_the_window_offsets():
    from workbench.rank import probe

    def by_hand(t: torch.Tensor) -> torch.Tensor:
        raw = t.contiguous().view(torch.uint8)
        if raw.numel() <= probe.RAW_SMALL:
            return raw[:0]
        return torch.cat([raw[o:o + probe.WINDOW] for o in probe.WINDOW_OFFSETS if o + probe.WINDOW <= raw.numel()])

    group = [torch.randn(n).to(torch.bfloat16) for n in (100, 300, 3000, 70000)]
    expected = torch.cat([by_hand(t) for t in group]).to(torch.float64)
    assert expected.numel() > 0 and torch.equal(probe._windows_many(group), expected)
    assert probe._windows_many([torch.zeros(10)]).numel() == 0  # small tensors keep no windows


def _lanes_by_hand(t: torch.Tensor) -> tuple[int, int]:
    """The fingerprint as docs/ and the probe's docstring define it, in plain Python integers with the constants
    written out: an independent reference (it shares no code or constant with the module it checks)."""
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    raw += bytes(-len(raw) % 4)
    m = 0xFFFFFFFF
    lane1 = lane2 = 0
    for i, (w,) in enumerate(struct.iter_unpack("<I", raw), start=1):
        a = ((w ^ ((i * 0x9E3779B1) & m)) * 0x85EBCA77) & m
        c = (((w + i * 0xC2B2AE3D) & m) * 0x27D4EB2F) & m
        lane1, lane2 = lane1 + (a ^ (a >> 15)), lane2 + (c ^ (c >> 13))
    return lane1 & m, lane2 & m


def test_the_fingerprint_reads_the_bytes_as_documented():
    """Fixed inputs against the hand reference, and the probe's column against it: equal bytes equal
    fingerprints, a moved word another one."""
    t = torch.arange(10, dtype=torch.float32)
    row = one(t)
    lanes = _lanes_by_hand(t)
    assert row["fingerprint"] == f"{lanes[0]:08x}{lanes[1]:08x}", (row["fingerprint"], lanes)
    assert _lanes_by_hand(t.flip(0)) != lanes and one(t.flip(0))["fingerprint"] != row["fingerprint"]


def test_poison_writes_the_documented_bit_patterns():
    """Signalling-NaN patterns per float dtype, written out here rather than read from the module."""
    patterns = {torch.float32: ("<I", 0x7FA5A5A5), torch.bfloat16: ("<H", 0x7FA5),
                torch.float16: ("<H", 0x7D5A), torch.float64: ("<Q", 0x7FF4A5A5A5A5A5A5)}
    for dtype, (fmt, bits) in patterns.items():
        t = poison_(torch.zeros(3, dtype=dtype))
        got = {w for (w,) in struct.iter_unpack(fmt, t.view(torch.uint8).numpy().tobytes())}
        assert got == {bits}, (dtype, [hex(w) for w in got])
        assert one(t)["poisoned"] == 3


def test_cpu_shortcuts_give_the_general_paths_values():
    """The all-finite shortcut and the in-place fingerprint are speed only: same numbers, same bits."""
    from workbench.rank import fingerprint as fp
    from workbench.rank.probe import _stats

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for n in (1, 7, 4097):
            t = (torch.randn(n, generator=g) * 3).to(dtype)
            x = t if dtype == torch.float64 else t.float()
            finite = torch.isfinite(x)
            general = [0, 0, 0, float(torch.where(finite, x, math.inf).min()),
                       float(torch.where(finite, x, -math.inf).max()),
                       float(torch.where(finite, x, 0.0).sum() / finite.sum().clamp(min=1))]
            assert [float(v) for v in _stats(t)[0]] == general, (dtype, n)
            assert tuple(int(v) for v in fp._fingerprint_lanes(t)) == _lanes_by_hand(t), (dtype, n)
    mixed = [("a", "tensor", torch.randn(600)), ("b", "tensor", torch.randn(700).bfloat16()),
             ("c", "tensor", torch.randn(900))]
    together = probe_tensors(mixed, 0)
    assert [r["windows"] for r in together] == [probe_tensors([m], 0)[0]["windows"] for m in mixed]


def _cpu_mix() -> list[tuple[str, str, torch.Tensor]]:
    """Tensors every way the CPU pass must read as the plain path does: each float dtype, sizes around the
    head, the raw and window lengths and the batch size, odd byte counts and offsets, values that are not
    finite, and poison."""
    g = torch.Generator().manual_seed(7)
    items = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for n in (1, 2, 3, 7, 8, 9, 64, 65, 129, 1000, 1025, 70_001):
            items.append((f"{dtype}-{n}", "tensor", (torch.randn(n, generator=g) * 3).to(dtype)))
    flat = torch.randn(4099, generator=g).to(torch.bfloat16)
    items += [("view-odd-offset", "tensor", flat[1:2001]), ("view-even-offset", "tensor", flat[2:2002]),
              ("strided", "tensor", torch.randn(40, 30, generator=g).t()),
              ("large", "tensor", torch.randn(300_000, generator=g)),  # over BATCH_BYTES: goes alone
              ("zeros", "tensor", torch.zeros(513)), ("ints", "buffer", torch.arange(100))]
    bad = torch.randn(600, generator=g)
    bad[[3, 70]] = float("nan")
    bad[500] = float("-inf")
    items.append(("non-finite", "tensor", bad))
    with poisoned():
        half = poison_(torch.empty(300))
    half[:150] = 1.0
    items.append(("half-poisoned", "tensor", half))
    return items


def test_cpu_batched_pass_gives_the_plain_paths_rows_bit_for_bit(monkeypatch):
    from workbench.rank import probe_cpu

    items = _cpu_mix()
    fast = probe_tensors(items, rank=0)
    calls = []
    monkeypatch.setattr(probe_cpu, "fill", lambda members: calls.append(len(members)) or members)
    plain = probe_tensors(items, rank=0)
    assert calls and calls[0] > 30  # the batched pass was what the first probe used
    assert repr(fast) == repr(plain)  # every column of every row (repr: a NaN in a head is equal to a NaN)
    bad = next(r for r in fast if r["name"] == "non-finite")
    assert (bad["nan"], bad["inf"], bad["poisoned"]) == (2, 1, 0)
    assert next(r for r in fast if r["name"] == "half-poisoned")["poisoned"] == 150


def test_cpu_pass_reuses_its_buffers_without_mixing_probes():
    a, b = torch.randn(5000), torch.randn(5000)
    first = probe_tensors([("a", "tensor", a), ("x", "tensor", torch.ones(10))], rank=0)
    second = probe_tensors([("b", "tensor", b), ("x", "tensor", torch.ones(10))], rank=0)
    again = probe_tensors([("a", "tensor", a), ("x", "tensor", torch.ones(10))], rank=0)
    assert first == again and first[0]["fingerprint"] != second[0]["fingerprint"]
    assert second[0]["max"] == float(b.max())


def test_a_tensor_two_objects_hold_is_read_once(monkeypatch):
    from workbench.rank import probe_cpu
    from workbench.rank.probe import probe_objects

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    wrapper = nn.ModuleDict({"inner": model})
    seen = []
    fill = probe_cpu.fill
    monkeypatch.setattr(probe_cpu, "fill", lambda members: seen.append(len(members)) or fill(members))
    rows = probe_objects({"model": model, "wrapped": wrapper}, rank=0)
    assert seen == [4]  # the wrapper's 4 tensors came from the model's rows, not a second pass
    by_name = {r["name"]: r for r in rows}
    for name in ("0.weight", "1.bias"):
        a, b = by_name[f"model.{name}"], by_name[f"wrapped.inner.{name}"]
        assert {k: a[k] for k in COLUMNS[8:]} == {k: b[k] for k in COLUMNS[8:]}
        assert a["head"] is not b["head"]
