"""Recorded CPU bundles (fixtures/bundles/): one per catalogue scenario.

Without engines: every scenario's bundle reloads, holds the bug path and every fix, and
renders through the same views and report a live session uses. With engines: a rerun of
each recorded run still finds what its recording found (findings, not timings) and reads
"reproduced" (exactly, or the same story within rounding on a machine other than the recorder's). When a
scenario changes on purpose, re-record: `.venv/bin/python scripts/record_fixtures.py NAME`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from workbench import scenarios, viz
from workbench.postmortem import bundle, report, rerun
from workbench.postmortem.record import RunRecord

ROOT = Path(__file__).resolve().parent.parent
BUNDLES = ROOT / "fixtures" / "bundles"
NAMES = scenarios.names()


def _bundle(name: str) -> bundle.Bundle:
    path = BUNDLES / f"{name}.wbundle"
    if not path.exists():
        pytest.fail(f"no recorded bundle for {name}: run `.venv/bin/python scripts/record_fixtures.py {name}`")
    return bundle.load(path)


def _key(row) -> tuple:
    rank = row["rank"]
    rank = None if rank is None or rank is pd.NA or (isinstance(rank, float) and math.isnan(rank)) else int(rank)
    return (row["step"], row["severity"], rank, row["name"] or "", row["detector"])


def finding_keys(found: pd.DataFrame) -> set[tuple]:
    """What a run found, without wording or numbers: (step, severity, rank, tensor, detector)."""
    return {_key(r) for r in found.to_dict(orient="records")}


def failure_keys(rec: RunRecord) -> set[tuple]:
    """Where ranks failed, and whether they died ('error' and 'timeout' are one kind: see rerun.failure_keys)."""
    return rerun.failure_keys(rec)


@pytest.mark.parametrize("name", NAMES)
def test_recorded_bundle_reloads_and_renders(name, recorded_report):
    b = _bundle(name)
    sc = scenarios.get(name)
    assert b.scenario == name
    assert [r.manifest.get("fix") for r in b] == [None, *sc.fixes], "re-record: the scenario's fixes changed"
    for rec, recorded in zip(b, b.recorded_findings):
        assert rec.manifest["steps"] == sc.step_names, "re-record: the scenario's steps changed"
        assert rec.manifest["backend"] == "gloo" and rec.manifest["ranks"] == 2
        assert recorded is not None and len(rec.tensors) > 0
        for step in rec.steps:
            t = rec.tensors[rec.tensors["step"] == step]
            if len(t):
                fig = viz.status_matrix(t)
                assert fig.data and len(fig.data[0].y) == t["rank"].nunique()
        for buf in report.interesting_buffers(rec):
            assert len(viz.buffer_values(rec.tensors, buf).data) >= 1
    page = recorded_report(name)  # report.render(b), rendered once per run (conftest)
    assert page.count('class="plotly-graph-div"') >= 2 * len(b)
    for fix in sc.fixes:
        assert f"Bug vs fix: {fix}" in page


@pytest.mark.parametrize("name", NAMES)
def test_recording_shows_the_bug_and_a_fix_removes_some_of_it(name):
    b = _bundle(name)
    bug = finding_keys(b.recorded_findings[0])
    assert bug, f"{name}: the recorded bug path found nothing"
    last = b[0].steps[-1]
    bug_end = {k for k in bug if k[0] == last and k[1] == "error"} | failure_keys(b[0])
    fixed_end = [{k for k in finding_keys(f) if k[0] == last and k[1] == "error"} | failure_keys(r)
                 for r, f in zip(b.records[1:], b.recorded_findings[1:])]
    if fixed_end:
        assert any(len(f) < len(bug_end) for f in fixed_end), f"{name}: no recorded fix removes anything"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_fresh_run_matches_recorded_findings_and_reruns_as_reproduced(healthy, name):
    """Each recorded run, rerun here: the same findings and failures, and the rerun verdict "reproduced"
    (exactly on the recorder's kind of machine, "same story" within the stated rounding on another:
    whichever machine recorded the fixture, nothing here compares bytes without a tolerance)."""
    b = _bundle(name)
    cluster = healthy
    for rec, recorded in zip(b, b.recorded_findings):
        if cluster.dead_ranks() or not cluster.wait_idle(cluster.timeout + 15):
            cluster.restart()
        verdict = rerun.rerun_record(rec, cluster)
        fresh = verdict.new
        label = f"{name} ({rec.label})"
        assert verdict.reproduced, verdict.message
        assert fresh.steps == rec.steps, label
        assert failure_keys(fresh) == failure_keys(rec), f"{label}: ranks fail differently than recorded"
        now, then = finding_keys(fresh.findings()), finding_keys(recorded)
        assert now == then, (f"{label}: findings changed; new: {sorted(now - then, key=str)[:8]}, "
                             f"gone: {sorted(then - now, key=str)[:8]}")
