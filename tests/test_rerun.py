"""Reruns of a postmortem: as recorded on live ranks, then diffed against the recording.

The diff itself is checked on doctored records (no engines); one engine test reruns a
recorded CPU fixture (reproduced exactly) and a doctored copy (the first difference and the
changed version are named). Bad bundles get one line before any engine starts.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from workbench import cli
from workbench.postmortem import bundle, rerun

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "bundles" / "to-empty-clobbers-buffers.wbundle"


def doctored(rec, **manifest):
    return dataclasses.replace(rec, manifest={**copy.deepcopy(rec.manifest), **manifest})


def test_diff_of_a_record_with_itself_is_exact_and_names_changed_versions():
    rec = bundle.load(FIXTURE).bug
    assert rerun.diff(rec, rec).message == "bug path: reproduced exactly"
    old = doctored(rec, versions={**rec.manifest["versions"], "torch": "1.0.0"})
    r = rerun.diff(old, rec)
    assert r.exact and r.changed["torch"] == ("1.0.0", rec.manifest["versions"]["torch"])
    assert "changed since the recording: torch 1.0.0 -> " in r.message


def test_diff_names_the_first_step_rank_and_tensor_where_runs_part():
    rec = bundle.load(FIXTURE).bug
    t = rec.tensors.copy()
    hit = (t["step"] == "materialize") & (t["rank"] == 1) & (t["name"] == "model.router.weight")
    assert hit.sum() == 1
    t.loc[hit, "fingerprint"] = "0" * 16
    r = rerun.diff(rec, dataclasses.replace(rec, tensors=t))
    assert not r.exact and r.first_difference["step"] == "materialize"
    assert r.message.startswith("bug path: differs from the recording from step `materialize`, rank 1, "
                                "`router.weight`: different bytes; no recorded version changed")


def _save(tmp_path, **manifest) -> Path:
    b = bundle.load(FIXTURE)
    return bundle.save([doctored(r, **manifest) for r in b], tmp_path / "doctored.wbundle")


@pytest.mark.parametrize("manifest, needle", [
    ({"scenario": "no-such-scenario"}, "the bundle's scenario 'no-such-scenario' is not in this workbench"),
    ({"ranks": 4096}, "the bundle was recorded on 4096 ranks; this machine starts at most"),
    ({"fix": "no-such-fix"}, "no-such-fix"),
])
def test_bad_bundles_get_one_line_before_engines_start(tmp_path, capsys, manifest, needle):
    path = _save(tmp_path, **manifest)
    assert cli.main(["rerun", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_rerun_reproduces_a_fixture_and_names_a_changed_parameter(healthy):
    b = bundle.load(FIXTURE)
    results = b.rerun(healthy)
    assert [r.message for r in results] == ["bug path: reproduced exactly",
                                            "fix: materialize-meta-only: reproduced exactly"]
    # the recording says seed 1 where it ran with 0, and an older torch: the rerun (seed 1) parts at the first
    # step that holds data (`build` is all meta)
    old = doctored(b.bug, params={**b.bug.manifest["params"], "seed": 1},
                   versions={**b.bug.manifest["versions"], "torch": "2.0.0"})
    r = rerun.rerun_record(old, healthy)
    assert r.message.startswith("bug path: differs from the recording from step `materialize`, rank 0, "
                                "`embed.weight`: different bytes"), r.message
    assert "changed since the recording: torch 2.0.0 -> " in r.message
    with pytest.raises(Exception, match="recorded on 4 ranks; only 2 can run here"):
        rerun.rerun_record(doctored(b.bug, ranks=4), healthy)
