"""Detectors on hand-made tensors and rows: each fires where it should and stays silent otherwise."""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn

from workbench.analysis import findings
from workbench.analysis.frames import COLUMNS, table
from workbench.lab.models import qwen3_config
from workbench.rank import poison, reference
from workbench.rank.probe import probe_tensors

EMPTY = pd.DataFrame()


def frame(*per_rank: list[tuple[str, torch.Tensor]], **extra_cols) -> pd.DataFrame:
    rows = []
    for rank, items in enumerate(per_rank):
        for row in probe_tensors([(n, "buffer", t) for n, t in items], rank):
            row.update({k: v[rank].get(row["name"]) for k, v in extra_cols.items()})
            rows.append(row)
    return table(rows, COLUMNS)


def test_reinterpretation_names_fp32_bytes_read_as_bf16():
    fp32 = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    as_bf16 = fp32.view(torch.bfloat16)[:32].clone()  # the first 64 bytes, read as bf16
    t = frame([("inv_freq", fp32)], [("inv_freq", as_bf16)])
    found = findings.reinterpretations(t)
    assert len(found) == 1 and found[0]["rank"] == 1
    assert found[0]["finding"] == ("rank 1 `inv_freq` (bfloat16) = rank 0 float32 bytes of `inv_freq` "
                                   "reinterpreted as bfloat16")


def test_reinterpretation_names_a_shift_into_another_tensor():
    a, b = torch.randn(64), torch.randn(64)
    shifted = torch.cat([b[16:], torch.zeros(16)])  # rank 1's `a` holds rank 0's `b` from element 16 on
    t = frame([("a", a), ("b", b)], [("a", shifted), ("b", b)])
    (found,) = findings.reinterpretations(t)
    assert found["source"] == "b" and found["offset"] == 64 and "from byte 64" in found["finding"]


def test_reinterpretation_is_silent_on_unrelated_zero_or_equal_bytes():
    a = torch.randn(64)
    assert findings.reinterpretations(frame([("a", a)], [("a", torch.randn(64))])) == []
    assert findings.reinterpretations(frame([("a", torch.zeros(64))], [("a", torch.zeros(32))])) == []
    assert findings.reinterpretations(frame([("a", a)], [("a", a.clone())])) == []


def test_divergence_names_the_diverging_rank_only():
    a = torch.randn(8)
    b = a.clone()
    b[3] += 1
    st = findings.status(frame([("x", a)], [("x", a.clone())], [("x", b)])).set_index("rank")["status"]
    assert list(st) == ["ok", "ok", "differs"]
    rows = findings.divergence("s", frame([("x", a)], [("x", b)]), EMPTY, EMPTY)
    assert [(r["rank"], r["detector"]) for r in rows] == [(1, "status differs")]


def test_rope_reference_is_exact_for_a_correct_bf16_cast_and_catches_garbage():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rope = Qwen3RotaryEmbedding(qwen3_config())
    expected = reference.expectations({"m": rope}, {})
    assert set(expected) == {"m.inv_freq", "m.original_inv_freq"}
    rows = [{"name": "m.inv_freq"}, {"name": "m.original_inv_freq"}, {"name": "m.other"}]
    good = rope.inv_freq.to(torch.bfloat16)
    bad = torch.full_like(rope.original_inv_freq, 0.5)
    reference.annotate(rows, {"m.inv_freq": good, "m.original_inv_freq": bad}, expected)
    assert rows[0]["ref_diff"] == 0.0 and rows[1]["ref_diff"] > 0.1 and rows[2]["ref_diff"] is None


def test_a_reference_diff_is_reused_only_for_the_same_bytes_against_the_same_expectation():
    """A point every step re-reads the rope's buffers: where the probe's hash of the whole tensor and the expectation
    are the last point's, so is the diff; new bytes (the job overwrote the buffer) are compared afresh."""
    exp = torch.linspace(0.1, 1.0, 8)
    buf = exp.clone()

    def diff(fingerprint: str | None, expected: torch.Tensor = exp) -> float | None:
        rows = [{"name": "m.inv_freq", "fingerprint": fingerprint}]
        reference.annotate(rows, {"m.inv_freq": buf}, {"m.inv_freq": expected})
        return rows[0]["ref_diff"]

    assert diff("00000000000000aa") == 0.0
    buf.fill_(5.0)  # new bytes, and the probe's hash with them
    assert diff("00000000000000bb") > 3.0
    assert diff("00000000000000aa") == 0.0  # the first bytes' hash: the first answer, reused
    assert diff(None) > 3.0  # no hash: always compared
    assert diff("00000000000000aa", exp.clone()) > 3.0  # another expectation: compared afresh


def test_reference_check_flags_garbage_every_rank_agrees_on():
    garbage = torch.full((32,), 7.0)
    diffs = [{"inv_freq": 6.0}, {"inv_freq": 6.0}]
    t = frame([("inv_freq", garbage)], [("inv_freq", garbage.clone())], ref_diff=diffs)
    assert (findings.status(t)["status"] == "reference").all()
    (row,) = findings.reference_check("s", t, EMPTY, EMPTY)
    assert "all ranks agree on the same wrong bytes" in row["finding"]
    ok = frame([("inv_freq", garbage)], [("inv_freq", garbage.clone())], ref_diff=[{"inv_freq": 0.0}] * 2)
    assert findings.reference_check("s", ok, EMPTY, EMPTY) == []


def with_probe_values(t: torch.Tensor) -> str | None:
    from workbench.rank.probe import probe_tensors

    (row,) = probe_tensors([("t", "tensor", t)], 0)
    return poison.written_state(t, row["poisoned"], row["fingerprint"])


def test_written_since_materialisation_with_and_without_poison():
    for poison_on in (False, True):
        with torch.device("meta"):
            m = nn.Linear(4, 4)
        with poison.poisoned(poison_on):
            m.to_empty(device="cpu")
        assert poison.written_state(m.weight) == with_probe_values(m.weight) == "never written"
        with torch.no_grad():
            m.weight[0].copy_(torch.tensor([11.37, -3.25, 7.5, 0.125]))  # not zeros: fresh pages often are
        state = poison.written_state(m.weight)
        assert state == ("partly written" if poison_on else "written"), (poison_on, m.weight, poison._TRACKED)
        assert with_probe_values(m.weight) == state  # the rank passes the probe's count and hash
        assert poison.written_state(torch.zeros(3)) is None  # never materialised: not tracked
    poison.uninstall()


def test_never_written_is_an_error_when_a_forward_read_it():
    t = frame([("w", torch.ones(4))], [("w", torch.ones(4))], written=[{"w": "written"}, {"w": "never written"}])
    (row,) = findings.never_written("init", t, EMPTY, EMPTY)
    assert row["rank"] == 1 and row["severity"] == "warning"
    outputs = pd.DataFrame([{"rank": 1, "name": "logits"}])
    (row,) = findings.never_written("forward", t, outputs, EMPTY)
    assert row["severity"] == "error" and row["finding"].startswith("a forward read 1 tensor(s) never written")


def test_reinterpretation_names_a_stream_that_slid_by_a_bucket():
    # NCCL paired rank 0's 256 B fp32 bucket with rank 1's bf16 bucket: rank 1's bytes are rank 0's, 256 B later
    w = torch.randn(8192).to(torch.bfloat16)
    slid = torch.cat([torch.randn(128).to(torch.bfloat16), w[:-128]])  # byte k here = byte k - 256 there
    (found,) = findings.reinterpretations(frame([("w", w)], [("w", slid)]))
    assert found["source"] == "w" and found["shift"] == 256 and found["at"] == 256 and found["offset"] == 0
    assert found["finding"] == ("rank 1 `w` (bfloat16) = rank 0's own bytes shifted up by 256 B "
                                "(128 bfloat16 elements): byte 256 here is byte 0 there")
    # the NCCL headline: rank 1's bucket holds two 64 B buffers ahead of the weights, rank 0 sent 256 B of fp32 first
    slid = torch.cat([torch.randn(64).to(torch.bfloat16), w[:-64]])  # 64 elements: byte k here = byte k - 128 there
    (found,) = findings.reinterpretations(frame([("w", w)], [("w", slid)]))
    assert found["shift"] == 128 and "shifted up by 128 B (64 bfloat16 elements)" in found["finding"]
    # a copy whose first bytes are right and whose tail differs is no reinterpretation
    tail = w.clone()
    tail[-100:] = 0
    assert findings.reinterpretations(frame([("w", w)], [("w", tail)])) == []


def test_every_uninitialised_allocation_under_a_step_is_poisoned_and_tracked():
    poison.reset_tracking()
    with poison.poisoned(True), poison.allocations():
        # a user's own materialisation path (Megatron-FSDP's fix), not to_empty
        m = nn.Linear(4, 4, device="meta")._apply(lambda t: torch.empty_like(t, device="cpu"))
        e = torch.empty(6)
        s = torch.empty_strided((2, 3), (3, 1))
        n = torch.zeros(2).new_empty(5)
        g = torch.ones(4)
        g.resize_(10)
    assert poison.written_state(m.weight) == "never written" and int(poison.poison_count(m.weight)) == 16
    assert all(int(poison.poison_count(t)) == t.numel() for t in (e, s, n))
    assert g[:4].tolist() == [1.0] * 4 and int(poison.poison_count(g)) == 6  # only the grown part
    m.weight.data[0].fill_(0.5)
    assert poison.written_state(m.weight) == "partly written"
    outside = torch.empty(6)  # no step running: the allocator is torch's own again
    assert poison.written_state(outside) is None
    with poison.poisoned(True), poison.allocations(), torch.device("meta"):
        assert nn.Embedding(10, 4).weight.is_meta  # building on meta still builds on meta


def test_findings_of_a_step_with_no_tensor_rows():
    """A step whose ranks all hung reports no tensors: the detectors must say nothing, not raise
    (found on NCCL: an empty boolean list selected no columns and lost 'name')."""
    empty = table([], [*COLUMNS, "ref_diff", "written", "sharded"])
    out = findings.findings("sync", empty, table([], COLUMNS), pd.DataFrame(columns=["rank", "kind"]))
    assert out.empty and list(out.columns) == findings.FINDING_COLUMNS
