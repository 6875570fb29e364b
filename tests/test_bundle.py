"""Bundles: a live run saved and loaded renders the same views; bad bundles give one clear error."""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workbench as wb
from workbench import viz
from workbench.errors import BundleError
from workbench.postmortem import bundle, report
from workbench.postmortem.record import RunRecord

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "bundles" / "fsdp1-rotary-meta-init.wbundle"


@pytest.fixture(scope="module")
def recorded() -> bundle.Bundle:
    return bundle.load(FIXTURE)


class Blob(bytes):
    def __repr__(self) -> str:  # keep hypothesis reports readable
        return f"<bundle bytes, {len(self)} B>"


@pytest.fixture(scope="module")
def recorded_page(recorded_report) -> str:
    """The recorded bundle's report page, rendered once a run (a render is ~6 s of CPU on the 2-core box; conftest's
    ``recorded_report``): the pages rendered again from a saved copy and by the command line must equal it byte
    for byte."""
    return recorded_report(FIXTURE.name.removesuffix(".wbundle"))


@pytest.fixture(scope="module")
def small(recorded, tmp_path_factory) -> bytes:
    """A one-run bundle (the bug path) as bytes: quick to load many times over."""
    path = bundle.save([recorded.bug], tmp_path_factory.mktemp("small") / "small.wbundle")
    return Blob(path.read_bytes())


def _figs_json(rec: RunRecord) -> list[str]:
    last = rec.tensors[rec.tensors["step_index"] == rec.tensors["step_index"].max()]
    return [viz.status_matrix(last).to_json(),
            viz.buffer_values(rec.tensors, report.interesting_buffers(rec)[0]).to_json()]


def _assert_same_record(a: RunRecord, b: RunRecord) -> None:
    assert a.manifest == b.manifest
    assert a.notes == b.notes
    for name in ("tensors", "outputs", "events"):
        x, y = getattr(a, name), getattr(b, name)
        assert list(x.columns) == list(y.columns), name
        assert len(x) == len(y), name
        assert [list(r) if isinstance(r, list) else r for r in x.astype(object).itertuples(index=False)] == \
               [list(r) if isinstance(r, list) else r for r in y.astype(object).itertuples(index=False)] or \
               x.astype(str).equals(y.astype(str)), name
    pd.testing.assert_frame_equal(a.findings().astype(str), b.findings().astype(str))


# -- a live run round trip ---------------------------------------------------------------
@pytest.mark.slow
def test_live_session_saves_and_loads_into_the_same_views(healthy, tmp_path):
    s = healthy.session("fsdp1-rotary-meta-init", fix="cast-params-only")
    s.run()
    live = s.record()
    # Two records of the same run are the same record: nothing in them depends on when they were taken.
    assert s.record().manifest == live.manifest
    path = s.save(tmp_path / "live")
    assert path.name == "live.wbundle" and path.is_file()
    loaded = wb.load(path)
    assert len(loaded) == 1
    back = loaded[0]
    assert back.manifest["scenario"] == "fsdp1-rotary-meta-init" and back.manifest["fix"] == "cast-params-only"
    assert back.manifest["backend"] == "gloo" and back.manifest["ranks"] == 2
    for key in ("versions", "devices", "seed", "poison", "started_at", "saved_at", "schema"):
        assert key in back.manifest, key
    pd.testing.assert_frame_equal(live.findings().astype(str), back.findings().astype(str))
    # The same functions draw the same figures, and the report is the same page byte for byte
    # (once the live record's machine paths get the placeholders the bundle stores).
    assert _figs_json(live) == _figs_json(back)
    assert report.render([bundle.portable(live)]) == report.render(loaded)
    live_trace = getattr(live, "trace", None)
    if isinstance(live_trace, pd.DataFrame):
        assert len(back.trace) == len(live_trace)


# -- round trip without engines ------------------------------------------------------------
def test_recorded_bundle_round_trips_exactly(recorded, tmp_path):
    again = bundle.load(bundle.save(recorded, tmp_path / "again.wbundle"))
    assert [r.label for r in again] == [r.label for r in recorded]
    for a, b in zip(recorded, again):
        _assert_same_record(a, b)
        assert _figs_json(a) == _figs_json(b)
    assert again.manifest["schema"] == bundle.BUNDLE_SCHEMA
    assert {"created_at", "writer", "runs", "format"} <= set(again.manifest)


def test_report_of_a_bundle_is_a_pure_function_of_its_records(recorded, recorded_page, tmp_path):
    again = bundle.load(bundle.save(recorded, tmp_path / "x.wbundle"))
    page = recorded_page
    assert page == report.render(again)
    assert page.count('class="plotly-graph-div"') >= 3 * len(recorded)
    for text in ("Environment", "Buffer values per rank", "Bug vs fix: cast-params-only", "torch version",
                 "inv_freq"):
        assert text in page, text
    assert page.count("<script") >= 2 and "<script src" not in page  # plotly.js inline, opens offline


def test_unpacked_directory_loads_like_the_file(recorded, tmp_path):
    path = bundle.save(recorded, tmp_path / "b.wbundle")
    d = bundle.unpack(path, tmp_path / "unpacked")
    assert (d / "manifest.json").is_file()
    from_dir = bundle.load(d)
    for a, b in zip(recorded, from_dir):
        _assert_same_record(a, b)


def test_save_is_atomic_a_crash_leaves_the_old_bundle(recorded, tmp_path, monkeypatch):
    path = bundle.save([recorded.bug], tmp_path / "keep.wbundle")
    before = path.read_bytes()
    calls = {"n": 0}
    real = zipfile.ZipFile.writestr

    def crash(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", crash)
    with pytest.raises(OSError, match="simulated"):
        bundle.save(recorded, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.wbundle"], "no temp file left behind"
    assert len(bundle.load(path)) == 1


def test_no_absolute_paths_of_the_writing_machine(recorded, tmp_path):
    import pyarrow.parquet as pq

    path = bundle.save(recorded, tmp_path / "p.wbundle")
    home, tmp = str(Path.home()), tempfile.gettempdir()
    machine = {str(ROOT), sys.prefix, os.path.realpath(sys.prefix), home, tmp, str(tmp_path)} - {"/", ""}
    texts = []
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            data = zf.read(name)
            if name.endswith(".parquet"):
                table = pq.read_table(io.BytesIO(data)).to_pandas()
                texts += [str(v) for col in table.columns for v in table[col]]
            else:
                texts.append(data.decode())
    hits = {p for p in machine for t in texts if p in t}
    assert not hits, f"machine paths inside the bundle: {hits}"
    joined = "\n".join(texts)
    assert "<site-packages>/torch" in joined  # tracebacks kept, paths replaced


def test_bundle_has_no_pickle(recorded, tmp_path):
    path = bundle.save(recorded, tmp_path / "p.wbundle")
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        assert names[0] == "manifest.json"
        assert all(n == "manifest.json" or n.endswith(".parquet") for n in names), names
        for n in names:
            assert b"\x80\x04\x95" not in zf.read(n)[:4]  # pickle protocol 4 header


# -- clear errors ------------------------------------------------------------------------
def _rewrite(src: bytes, dst: Path, manifest=None, member=None, data=None) -> Path:
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            blob = zin.read(name)
            if name == "manifest.json" and manifest is not None:
                blob = json.dumps(manifest).encode()
            if name == member:
                blob = data
            zout.writestr(name, blob)
    return dst


def _manifest(src: bytes) -> dict:
    with zipfile.ZipFile(io.BytesIO(src)) as z:
        return json.loads(z.read("manifest.json"))


def _error(path: Path) -> str:
    with pytest.raises(BundleError) as exc:
        bundle.load(path)
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) < 600, msg
    return msg


def test_missing_bundle(tmp_path):
    assert "no bundle at" in _error(tmp_path / "nope.wbundle")


def test_truncated_bundle(small, tmp_path):
    p = tmp_path / "t.wbundle"
    p.write_bytes(small[: len(small) // 2])
    assert "truncated" in _error(p) or "corrupt" in _error(p)


def test_not_a_bundle(tmp_path):
    p = tmp_path / "x.wbundle"
    p.write_text("hello")
    assert "not a workbench bundle" in _error(p)
    with zipfile.ZipFile(tmp_path / "z.wbundle", "w") as z:
        z.writestr("other.txt", "x")
    assert "manifest.json is missing" in _error(tmp_path / "z.wbundle")


def test_corrupt_table_is_named(small, tmp_path):
    m = _manifest(small)
    member = m["runs"][0]["tables"]["tensors"]["file"]
    with zipfile.ZipFile(io.BytesIO(small)) as z:
        data = bytearray(z.read(member))
    data[len(data) // 2] ^= 0xFF
    msg = _error(_rewrite(small, tmp_path / "c.wbundle", member=member, data=bytes(data)))
    assert member in msg and "checksum" in msg


def test_newer_schema_says_upgrade(small, tmp_path):
    m = _manifest(small)
    m["schema"] = bundle.BUNDLE_SCHEMA + 1
    assert "newer workbench" in _error(_rewrite(small, tmp_path / "n.wbundle", manifest=m))
    m = _manifest(small)
    m["runs"][0]["manifest"]["schema"] = 99
    assert "newer workbench" in _error(_rewrite(small, tmp_path / "r.wbundle", manifest=m))


def test_wrong_types_in_manifest(small, tmp_path):
    m = _manifest(small)
    m["runs"][0]["manifest"]["steps_run"] = "load"
    assert "steps_run" in _error(_rewrite(small, tmp_path / "w.wbundle", manifest=m))
    m = _manifest(small)
    del m["runs"][0]["tables"]["tensors"]
    assert "tensors" in _error(_rewrite(small, tmp_path / "d.wbundle", manifest=m))


# -- fuzz: damaged bundles raise BundleError and nothing else -------------------------------
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load_or_bundle_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "f.wbundle"
        p.write_bytes(data)
        try:
            b = bundle.load(p)
        except BundleError as exc:
            assert "\n" not in str(exc)
            return
        # Whatever loads must still give the manifest-driven views their types.
        report.environment(list(b))
        for r in b:
            report.timings(r)
            assert isinstance(r.tensors, pd.DataFrame)


@FUZZ
@given(cut=st.integers(min_value=0, max_value=10**9))
def test_fuzz_truncated(small, cut):
    _load_or_bundle_error(small[: cut % len(small)])


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)),
                      min_size=1, max_size=4))
def test_fuzz_flipped_bytes(small, flips):
    data = bytearray(small)
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    _load_or_bundle_error(bytes(data))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                    max_leaves=6)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, (*prefix, i))


@FUZZ
@given(data=st.data())
def test_fuzz_wrong_types_in_manifest(small, data):
    m = _manifest(small)
    paths = [p for p in _paths(m) if p]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(JSON)
    target = m
    for k in path[:-1]:
        target = target[k]
    if data.draw(st.booleans()) and isinstance(target, dict):
        del target[path[-1]]
    else:
        target[path[-1]] = value
    buf = io.BytesIO()
    _rewrite(small, buf, manifest=m)
    _load_or_bundle_error(buf.getvalue())


# -- the command line --------------------------------------------------------------------
def test_cli_report_from_a_bundle(recorded, recorded_page, tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "r.html"
    assert main(["report", str(FIXTURE), "-o", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    # the page of the same file, loaded once for this module (``recorded`` is ``bundle.load(FIXTURE)``)
    assert page.startswith("<!DOCTYPE html>") and page == recorded_page
    bad = tmp_path / "bad.wbundle"
    bad.write_bytes(FIXTURE.read_bytes()[:1000])
    assert main(["report", str(bad), "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("workbench: error: ") and "\n" not in err and str(bad) in err
    assert not (tmp_path / "x.html").exists()


def test_columns_pyarrow_cannot_type_round_trip_as_json(recorded, tmp_path):
    rec = recorded.bug
    outputs = rec.outputs.copy()
    outputs["extra"] = [{"k": [1, 2]}, "text"] + [None] * (len(outputs) - 2)
    odd = RunRecord(rec.manifest, rec.tensors, outputs, rec.events, rec.notes)
    back = bundle.load(bundle.save(odd, tmp_path / "odd.wbundle"))[0]
    assert list(back.outputs["extra"])[:2] == [{"k": [1, 2]}, "text"]
    with zipfile.ZipFile(tmp_path / "odd.wbundle") as z:
        spec = json.loads(z.read("manifest.json"))["runs"][0]["tables"]["outputs"]
    assert spec["json_columns"] == ["extra"]


# -- hostile manifests: every field checked against what it describes, bounded cost ----------
def _with_run_field(src: bytes, dst: Path, key: str, value) -> Path:
    m = _manifest(src)
    m["runs"][0]["manifest"][key] = value
    return _rewrite(src, dst, manifest=m)


@pytest.mark.parametrize("value", [10**12, 100_000, "abc", 0, -1, True, 2.5, [2]])
def test_absurd_world_size_is_refused_at_load(small, tmp_path, value):
    msg = _error(_with_run_field(small, tmp_path / "r.wbundle", "ranks", value))
    assert "'ranks'" in msg and "world size" in msg


def test_a_world_size_its_devices_do_not_back_is_refused(small, tmp_path):
    assert "'devices' names 2 rank(s)" in _error(_with_run_field(small, tmp_path / "r.wbundle", "ranks", 4096))
    m = _manifest(small)
    m["runs"][0]["manifest"].update(ranks=4096, devices={})
    assert "'devices' names 0 rank(s)" in _error(_rewrite(small, tmp_path / "e.wbundle", manifest=m))


@pytest.mark.parametrize("key, value", [
    ("timeout_s", "abc"), ("timeout_s", -1), ("seed", 10**40), ("poison", "yes"), ("backend", 3),
    ("started_at", "noon"), ("devices", {"7": "cpu"}), ("devices", {"x": "cpu"}),
    ("elapsed", [{"0": "fast"}]), ("devices", {"0": "cpu"}), ("elapsed", [{}] * 50),
    ("hangs", [{"stuck": {"9": "x"}}]), ("hangs", ["x"]),
])
def test_each_manifest_field_is_checked_against_what_it_describes(small, tmp_path, key, value):
    assert repr(key) in _error(_with_run_field(small, tmp_path / "f.wbundle", key, value))


def test_a_rank_in_the_tables_outside_the_manifest_world_is_named(small, tmp_path):
    m = _manifest(small)
    m["runs"][0]["manifest"].update(ranks=1, devices={"0": "cpu"}, elapsed=[], hangs=[])
    msg = _error(_rewrite(small, tmp_path / "w.wbundle", manifest=m))  # the tables hold ranks 0 and 1
    assert "names rank 1" in msg and "outside" in msg


def test_a_table_declaring_more_rows_than_the_manifest_is_refused_before_decoding(small, tmp_path):
    m = _manifest(small)
    m["runs"][0]["tables"]["tensors"]["rows"] = 10**12
    assert "declares" in _error(_rewrite(small, tmp_path / "rows.wbundle", manifest=m))


def test_cli_rerun_of_a_crafted_bundle_is_one_line(small, tmp_path, capsys):
    from workbench.cli import main

    path = _with_run_field(small, tmp_path / "abc.wbundle", "ranks", "abc")
    assert main(["rerun", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("workbench: error: ") and "\n" not in err and "'ranks'" in err


FUZZ_UNDER_CAP = r'''
import io, json, resource, sys, tempfile, zipfile
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (MEM, MEM))
from hypothesis import given, settings, HealthCheck, strategies as st
from workbench.analysis import diagnosis
from workbench.errors import BundleError
from workbench.postmortem import bundle, report
src = Path(sys.argv[1]).read_bytes()
with zipfile.ZipFile(io.BytesIO(src)) as z:
    BASE = json.loads(z.read("manifest.json"))
BIG = st.sampled_from([10**12, 10**18, -10**18, 2**63, 2**64 + 1, 100_000, 4097, 1e308, -1e308, 0, -1,
                       float("inf"), float("nan"), True, "abc", "9" * 4000, "x" * 100_000, None])
HUGE = BIG | st.lists(BIG, max_size=3) | st.dictionaries(st.sampled_from(["0", "1", "999999", "-1", "x"]), BIG,
                                                         max_size=3)
KEYS = ["ranks", "timeout_s", "seed", "started_at", "saved_at", "steps", "steps_run", "elapsed", "hangs",
        "devices", "params", "poison", "backend", "fix", "scenario", "schema"]
ROWS = st.sampled_from([None, 10**12, -1, 2**63, "1"])
n = {"ok": 0, "refused": 0}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(fields=st.dictionaries(st.sampled_from(KEYS), HUGE, min_size=1, max_size=3), rows=ROWS,
       elapsed_n=st.sampled_from([0, 1, 10**5]))
def fuzz(fields, rows, elapsed_n):
    m = json.loads(json.dumps(BASE))
    run = m["runs"][0]
    run["manifest"].update(fields)
    if elapsed_n == 10**5:
        run["manifest"]["elapsed"] = [{"0": 1.0}] * elapsed_n
    if rows is not None:
        run["tables"]["events"]["rows"] = rows
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(buf, "w") as zout:
        for name in zin.namelist():
            zout.writestr(name, json.dumps(m) if name == "manifest.json" else zin.read(name))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "f.wbundle"
        p.write_bytes(buf.getvalue())
        try:
            b = bundle.load(p)
        except BundleError as exc:
            assert "\n" not in str(exc)
            n["refused"] += 1
            return
    for r in b:  # whatever loads, every view of it runs in bounded memory
        report.environment([r]); report.timings(r)
        d = r.diagnose()
        diagnosis.grid(r, d)
    n["ok"] += 1


fuzz()
print("fuzzed", n)
'''


def test_fuzz_absurd_manifest_values_under_a_memory_cap(small, tmp_path):
    """Absurd values in every manifest field: each bundle loads (and its views run) or is refused in
    one line, inside a 3 GiB address-space cap: an OOM or MemoryError fails the subprocess."""
    import subprocess

    src = tmp_path / "small.wbundle"
    src.write_bytes(small)
    code = FUZZ_UNDER_CAP.replace("MEM", str(3 << 30)).replace("EXAMPLES", "120")
    out = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=900,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fuzzed" in out.stdout and "'refused': 0" not in out.stdout, out.stdout


@pytest.mark.parametrize("name", ["eval-loop-uneven-batches", "weight-sync-order-desync", "stale-conversion-cache"])
def test_the_report_words_every_failure_never_a_backends_raw_message(name, recorded_report):
    """The per-rank failures read in the workbench's words: a call it released says so, a later call on the
    aborted group says that, an engine that died says it died; gloo's source file and ipyparallel's task ids never
    reach the page (the raw messages stay in the bundle's events)."""
    b = bundle.load(Path(__file__).resolve().parent.parent / "fixtures" / "bundles" / f"{name}.wbundle")
    raw = pd.concat([rec.events for rec in b])["message"].astype(str)
    assert raw.str.contains("pair.cc").any()  # the recording holds gloo's own words...
    page = recorded_report(name)  # report.render(b), rendered once per run (conftest)
    for words in ("pair.cc", "third_party/gloo", "Connection closed by peer", "while running task",
                  "This is typically caused"):
        assert words not in page, words  # ...the page does not
    assert "aborted by the workbench: it released" in page  # each of these runs had a deadlock released
