"""Reruns of a postmortem: as recorded on live ranks, then compared with the recording.

Three verdicts (``workbench.postmortem.rerun``): "reproduced exactly" for the same bytes,
"reproduced: same story" for bytes that differ within rounding (another CPU's kernels), and
"differs" for another story, named at its first step, rank and tensor. The comparison is
checked on recordings doctored the way another machine or a real change would move them (one
ulp; a tensor clearly off; another step failing; never-written memory without poison), without
engines. Engine tests rerun a recorded CPU fixture (reproduced, whichever machine recorded it)
and a run recorded under other float kernels (``ATEN_CPU_CAPABILITY=default``: no SIMD), which
must read "same story", and "differs" under ``strict``. Bad bundles get one line before any
engine starts.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ready

from workbench import cli
from workbench.postmortem import bundle, closeness, rerun

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "bundles" / "to-empty-clobbers-buffers.wbundle"
BF16 = ROOT / "fixtures" / "bundles" / "fsdp1-rotary-meta-init.wbundle"
REPRODUCED = ("bug path: reproduced exactly", "bug path: reproduced: same story, values within rounding (")


def doctored(rec, **manifest):
    return dataclasses.replace(rec, manifest={**copy.deepcopy(rec.manifest), **manifest})


def _decode(hex_bytes: str, dtype: str) -> np.ndarray:
    data = bytes.fromhex(hex_bytes)
    return np.frombuffer(data, dtype="<u2" if dtype == "bfloat16" else "<u4").copy()


def _value(bits: int, dtype: str) -> float:
    if dtype == "bfloat16":
        return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def moved(rec, table: str, step: str, name: str, *, ulps: int = 0, factor: float = 1.0, ranks=None):
    """``rec`` with one tensor (or output) moved on ``ranks`` (default: every rank, as another machine's
    kernels move it): its first element by ``ulps`` units in the last place (where finite), or every kept
    value times ``factor``. The fingerprint changes the same way on every rank, so ranks that agreed still agree."""
    df = getattr(rec, table).copy()
    hit = (df["step"] == step) & (df["name"] == name) & (df["rank"].isin(ranks) if ranks is not None else True)
    assert hit.sum() >= 1, (table, step, name)
    for i in df.index[hit]:
        row = df.loc[i]
        dtype = row["dtype"]
        fp = f"{int(row['fingerprint'], 16) ^ 0x5A5A:016x}"
        raw = _decode(row["raw"], dtype)
        if ulps:
            if not np.isfinite(_value(int(raw[0]), dtype)):
                continue  # NaN (a poisoned rank's logits) has no next value: another machine leaves it as it is
            raw[0] += ulps
            head = list(row["head"])
            head[0] = _value(int(raw[0]), dtype)
            df.at[i, "head"] = head
        else:
            df.at[i, "head"] = [v * factor for v in row["head"]]
            for k in ("min", "max", "mean"):
                df.at[i, k] = row[k] * factor
            vals = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else raw.view(np.float32)
            vals = (vals * np.float32(factor)).astype(np.float32)
            raw = (vals.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else vals.view(np.uint32)
        df.at[i, "raw"] = raw.tobytes().hex()
        df.at[i, "fingerprint"] = fp
    return dataclasses.replace(rec, **{table: df})


def test_diff_of_a_record_with_itself_is_exact_and_names_changed_versions():
    rec = bundle.load(FIXTURE).bug
    assert rerun.diff(rec, rec).message == "bug path: reproduced exactly"
    old = doctored(rec, versions={**rec.manifest["versions"], "torch": "1.0.0"})
    r = rerun.diff(old, rec)
    assert r.exact and r.changed["torch"] == ("1.0.0", rec.manifest["versions"]["torch"])
    assert "changed since the recording: torch 1.0.0 -> " in r.message


@pytest.mark.parametrize("path, table, step, name", [
    (FIXTURE, "tensors", "materialize", "model.router.weight"),  # fp32 parameter
    (FIXTURE, "outputs", "route", "hidden"),  # fp32 output
    (BF16, "outputs", "forward", "logits"),  # a bf16 model's fp32 logits
])
def test_one_ulp_reads_same_story_and_strict_reads_differs(path, table, step, name):
    rec = bundle.load(path).bug
    then = doctored(rec, versions={**rec.manifest["versions"], "cpu": "Another CPU", "transformers": "5.0.0"})
    now = moved(rec, table, step, name, ulps=1)
    r = rerun.diff(then, now)
    assert r.verdict == rerun.SAME_STORY and not r.exact and r.reproduced, r.message
    assert r.message.startswith("bug path: reproduced: same story, values within rounding (max |Δ| "), r.message
    t = getattr(rec, table)
    finite = sum(1 for h in t[(t["step"] == step) & (t["name"] == name)]["head"] if h[0] == h[0])
    assert f"at step `{step}`, rank 0, `" in r.message and f"bytes differ in {finite} of " in r.message
    assert r.message.endswith(f"changed: cpu Another CPU -> {rec.manifest['versions']['cpu']}; "
                              f"transformers 5.0.0 -> {rec.manifest['versions']['transformers']}"), r.message
    assert 0 < r.worst["delta"] <= r.worst["tol"]
    s = rerun.diff(then, now, strict=True)
    assert not s.reproduced and s.first_difference["step"] == step, s.message
    assert s.message.startswith(f"bug path: differs from the recording from step `{step}`, rank 0, "), s.message


@pytest.mark.parametrize("path, table, step, name, short, rank", [
    (FIXTURE, "tensors", "materialize", "model.router.weight", "router.weight", 1),
    (BF16, "outputs", "forward", "logits", "logits", 0),  # rank 1's logits are NaN (poison) in this run
])
def test_a_tensor_clearly_off_reads_differs_naming_step_rank_and_tensor(path, table, step, name, short, rank):
    rec = bundle.load(path).bug
    r = rerun.diff(rec, moved(rec, table, step, name, factor=1.5, ranks=[rank]))
    assert not r.reproduced
    assert r.message.startswith(f"bug path: differs from the recording from step `{step}`, rank {rank}, `{short}`: "
                                f"{'output ' if table == 'outputs' else ''}values off by up to "), r.message
    # the same change on every rank is still a change of values, not rounding
    assert not rerun.diff(rec, moved(rec, table, step, name, factor=1.05)).reproduced


def test_another_step_failing_or_another_nan_pattern_reads_differs():
    rec = bundle.load(FIXTURE).bug
    ev = pd.DataFrame([{"step": "route", "step_index": 2, "rank": 1, "kind": "error", "error": "RuntimeError",
                        "message": "boom", "traceback": ""}])
    r = rerun.diff(rec, dataclasses.replace(rec, events=ev))
    assert r.message.startswith("bug path: differs from the recording from step `route`, rank 1: "
                                "rank 1 failed in the rerun only"), r.message
    t = rec.tensors.copy()
    hit = (t["step"] == "materialize") & (t["name"] == "model.router.expert_bias")
    t.loc[hit, "poisoned"] = 7  # one element of the poison now written: a NaN pattern is never rounding
    t.loc[hit, "fingerprint"] = "0" * 16
    r = rerun.diff(rec, dataclasses.replace(rec, tensors=t))
    assert r.message.startswith("bug path: differs from the recording from step `materialize`, rank 0, "
                                "`expert_bias`: 8 poisoned then, 7 now"), r.message


def test_one_rank_parting_from_the_others_is_another_story():
    """Bytes on one rank only, with the kept values equal: the ranks now disagree (a finding)."""
    rec = bundle.load(FIXTURE).bug
    t = rec.tensors.copy()
    hit = (t["step"] == "materialize") & (t["rank"] == 1) & (t["name"] == "model.router.weight")
    t.loc[hit, "fingerprint"] = "0" * 16
    r = rerun.diff(rec, dataclasses.replace(rec, tensors=t))
    assert not r.reproduced and r.first_difference["step"] == "materialize"
    assert r.message.startswith("bug path: differs from the recording from step `materialize`, rank 1, "
                                "`router.weight`: a `status differs` finding (warning) in the rerun only"), r.message
    assert rerun.diff(rec, dataclasses.replace(rec, tensors=t), strict=True).message == r.message


def test_never_written_memory_without_poison_is_not_compared_but_its_state_is():
    rec = doctored(bundle.load(FIXTURE).bug, poison=False)
    t = rec.tensors.copy()
    hit = (t["name"] == "model.router.expert_bias") & (t["written"] == "never written")
    t.loc[hit, "nan"], t.loc[hit, "poisoned"], t.loc[hit, "fingerprint"] = 3, 0, "1" * 16
    t.loc[hit, "head"] = pd.Series([[1e30, -2.0, 0.0, 5.0, 1.0, 1.0, 1.0, 1.0]] * int(hit.sum()), index=t.index[hit])
    r = rerun.diff(rec, dataclasses.replace(rec, tensors=t))
    assert r.verdict == rerun.SAME_STORY, r.message
    assert f"{int(hit.sum())} never-written without poison, not compared" in r.message
    # ... but a buffer now written (the story's point) is a change, and poison on compares every value
    t2 = t.copy()
    t2.loc[hit & (t2["step"] == "route") & (t2["rank"] == 0), "written"] = "written"
    r = rerun.diff(rec, dataclasses.replace(rec, tensors=t2))
    assert r.message.startswith("bug path: differs from the recording from step `route`, rank 0, "
                                "`expert_bias`: never written then, written now"), r.message
    poisoned = doctored(rec, poison=True)
    assert not rerun.diff(poisoned, dataclasses.replace(poisoned, tensors=t)).reproduced


def test_tolerances_are_stated_per_dtype():
    assert closeness.rtol("float32") == 2 ** -16 and closeness.rtol("bfloat16") == 2 ** -5
    assert closeness.rtol("float32", floor="bfloat16") == 2 ** -5  # a bf16 model's fp32 outputs
    assert closeness.rtol("int64") is None  # integers match exactly
    assert closeness.floor_dtype(bundle.load(BF16).bug.tensors) == "bfloat16"


def _save(tmp_path, **manifest) -> Path:
    b = bundle.load(FIXTURE)
    return bundle.save([doctored(r, **manifest) for r in b], tmp_path / "doctored.wbundle")


@pytest.mark.parametrize("manifest, needle", [
    ({"scenario": "no-such-scenario"}, "the bundle's scenario 'no-such-scenario' is not in this workbench"),
    ({"ranks": 4096, "devices": {str(r): "cpu" for r in range(4096)}},  # a world its devices back
     "the bundle was recorded on 4096 ranks; this machine starts at most"),
    ({"fix": "no-such-fix"}, "no-such-fix"),
])
def test_bad_bundles_get_one_line_before_engines_start(tmp_path, capsys, manifest, needle):
    path = _save(tmp_path, **manifest)
    assert cli.main(["rerun", str(path), "--strict"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_rerun_reproduces_a_fixture_and_names_a_changed_parameter(healthy):
    b = bundle.load(FIXTURE)
    results = b.rerun(healthy)
    # exactly on the recorder's kind of machine, the same story on another: never "differs"
    assert all(r.reproduced for r in results), [r.message for r in results]
    assert [r.message.split(":")[0] for r in results] == ["bug path", "fix"]
    # the recording says seed 1 where it ran with 0, an older torch and another CPU (the recorder's identity is an
    # input here, so this reads the same on the recorder's CPU and any other): the rerun (seed 1) parts at the
    # first step that holds data (`build` is all meta)
    old = doctored(b.bug, params={**b.bug.manifest["params"], "seed": 1},
                   versions={**b.bug.manifest["versions"], "torch": "2.0.0", "cpu": "A CPU no one has"})
    r = rerun.rerun_record(old, healthy)
    assert r.message.startswith("bug path: differs from the recording from step `materialize`, rank 0, "
                                "`embed.weight`: values off by up to "), r.message
    assert r.changed["torch"][0] == "2.0.0" and r.changed["cpu"][0] == "A CPU no one has", r.changed
    changed = r.message.split("; changed since the recording: ", 1)[1].split("; ")  # in any order
    assert any(c.startswith("torch 2.0.0 -> ") for c in changed) and any(
        c.startswith("cpu A CPU no one has -> ") for c in changed), r.message
    with pytest.raises(Exception, match="recorded on 4 ranks; only 2 can run here"):
        rerun.rerun_record(doctored(b.bug, ranks=4), healthy)


@pytest.mark.slow
def test_a_run_recorded_under_other_float_kernels_reads_same_story(healthy, another_cpu):
    """Engines without SIMD kernels (``ATEN_CPU_CAPABILITY=default``) stand in for another CPU: their
    bytes differ from this machine's, the story does not."""
    other = ready(another_cpu)
    s = other.session("to-empty-clobbers-buffers")
    s.run()
    then = s.record()  # names the kernels the ranks ran with (their own environment, not this process's)
    s.close()
    # the committed fixtures, recorded on another machine, rerun on this "other CPU": reproduced, never
    # "differs" (exactly, or the same story within rounding)
    for r in bundle.load(FIXTURE).rerun(other):
        assert r.reproduced, r.message
    assert then.manifest["versions"]["ATEN_CPU_CAPABILITY"] == "default"
    assert then.manifest["versions"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    r = rerun.rerun_record(then, healthy)
    assert r.verdict == rerun.SAME_STORY, r.message
    assert r.bytes_differ > 0
    # what changed is what this machine's ranks ran with: unset here, another setting where the suite itself
    # runs under other kernels (ATEN_CPU_CAPABILITY=avx2, say): both must read right
    now = healthy.kernels[0]
    assert now.get("ATEN_CPU_CAPABILITY") != "default"  # else the two runs would not differ in their kernels
    for knob, then_value in (("ATEN_CPU_CAPABILITY", "default"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        if now.get(knob) == then_value:
            assert knob not in r.changed, r.changed
            continue
        assert r.changed[knob] == (then_value, now.get(knob)), r.changed
        assert f"{knob} {then_value} -> {now.get(knob) or 'unset'}" in r.message, r.message
    assert not rerun.rerun_record(then, healthy, strict=True).reproduced
