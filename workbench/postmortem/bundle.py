"""Postmortem bundles: save a run (bug path and fixes) and load it anywhere, without GPUs.

A bundle is one zip file (``*.wbundle``) or the same layout unpacked into a directory::

    manifest.json                 format, schema, versions, one entry per run
    runs/<i>/<table>.parquet      tensors, outputs, events (and ledger, findings, ...)

No pickle anywhere: tables are Parquet, the manifest is JSON. Every table's sha256 is in
the manifest, so a flipped byte or a truncated file is named, not half-loaded. Writes go
to a temporary sibling that is renamed into place, so a crash mid-save never leaves a
half bundle under the chosen name. Machine paths (the checkout, the interpreter, home,
temp dirs) are replaced by placeholders such as ``<site-packages>`` before writing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.analysis.frames import jsonable
from workbench.errors import BundleError
from workbench.postmortem.record import FINDINGS_FAULTS, SCHEMA_VERSION, RunRecord, damage_faults

FORMAT = "workbench-bundle"
BUNDLE_SCHEMA = 1  # the layout of this file; RunRecord manifests carry their own ``schema``
SUFFIX = ".wbundle"
MANIFEST = "manifest.json"
MAX_MEMBER_BYTES = 512 * 1024 * 1024
# A run's world size: the views loop over ranks x steps, so an absurd count in a small manifest would cost
# hours and gigabytes (``"ranks": 10**12`` would build set(range(n))). Far above any ipyparallel job.
MAX_RANKS = 4096
MAX_TABLE_ROWS = 20_000_000  # a Parquet table's declared rows, checked before it is decoded
MAX_TABLE_BYTES = 4 * MAX_MEMBER_BYTES  # ... and its declared uncompressed size
RANK_TABLES = ("tensors", "outputs", "events", "ledger")  # tables whose ``rank`` column the views index
# Tables every run must have, with the columns the views need.
REQUIRED = {
    "tensors": ["step", "step_index", "rank", "name", "kind", "dtype", "is_meta", "numel", "head", "fingerprint"],
    "outputs": [],
    "events": [],
}


# -- the records a bundle holds ----------------------------------------------------------
class Bundle:
    """The runs of a loaded bundle: iterate it, index it, or hand it to the views/report."""

    def __init__(self, records: list[RunRecord], manifest: dict[str, Any],
                 recorded_findings: list[pd.DataFrame | None] | None = None, source: str = ""):
        self.records = records
        self.manifest = manifest
        self.recorded_findings = recorded_findings or [None] * len(records)
        self.source = source
        self.problems: list[str] = []  # a directory of shards: what did not fit (a missing rank, ...), a line each

    def __iter__(self) -> Iterator[RunRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> RunRecord:
        return self.records[i]

    @property
    def scenario(self) -> str:
        return self.records[0].manifest.get("scenario", "") if self.records else ""

    @property
    def bug(self) -> RunRecord | None:
        return next((r for r in self.records if not r.manifest.get("fix")), None)

    def run(self, fix: str | None) -> RunRecord:
        """The run of one fix (``None``: the bug path)."""
        for r in self.records:
            if r.manifest.get("fix") == fix:
                return r
        have = [r.manifest.get("fix") or "(bug path)" for r in self.records]
        raise BundleError(f"bundle has no run for fix {fix!r}; it has: {', '.join(have)}")

    def render(self) -> str:
        from workbench.postmortem import report

        return report.render(self.records)

    def report(self, path: str | os.PathLike) -> Path:
        from workbench.postmortem import report

        return report.write(self.records, path)

    def rerun(self, cluster: Any, strict: bool = False) -> list[Any]:
        """Run every recorded run again on ``cluster`` (fix, params, seed, poison, world size as recorded) and
        compare each with its recording: a list of ``workbench.postmortem.rerun.Rerun`` (print them).
        ``strict``: only bit-identical runs reproduce (else the same story within rounding does)."""
        from workbench.postmortem import rerun

        for rec in self.records:  # every run checked before the first starts
            rerun.check(rec, getattr(cluster, "world_size", None))
        return [rerun.rerun_record(rec, cluster, strict=strict) for rec in self.records]

    def __repr__(self) -> str:
        runs = ", ".join(r.label for r in self.records)
        return f"<Bundle {self.scenario}: {runs}>"


def as_records(obj: Any) -> list[RunRecord]:
    """RunRecords from a RunRecord, a Bundle, anything that hands out its records (a live
    Session or Comparison: ``obj.records()``), or an iterable of them.

    Duck-typed on purpose: the postmortem layer must not import the live layer.
    """
    if isinstance(obj, RunRecord):
        return [obj]
    if isinstance(obj, Bundle):
        return list(obj.records)
    if callable(getattr(obj, "records", None)):
        return list(obj.records())
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes, dict)):
        out: list[RunRecord] = []
        for item in obj:
            out += as_records(item)
        return out
    raise TypeError(f"cannot save {type(obj).__name__}: give a Session, Comparison, RunRecord or a list of them")


def _tables(rec: RunRecord) -> dict[str, pd.DataFrame]:
    """Every DataFrame field of the record (tensors, outputs, events, ledger when present)."""
    return {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)
            if isinstance(getattr(rec, f.name), pd.DataFrame)}


# -- machine paths out -------------------------------------------------------------------
def _temp_dirs() -> list[str]:
    """Every directory that is this machine's temp dir: what ``tempfile`` uses, and what TMPDIR, TEMP and TMP
    name even where ``tempfile`` does not (it read them once and cached its answer, or skipped one it cannot
    write to): a user whose TMPDIR points at a data disk has paths there, whatever this process's tempfile says."""
    named = [os.environ.get(var, "") for var in ("TMPDIR", "TEMP", "TMP")]
    return [tempfile.gettempdir(), *(d for d in named if os.path.isabs(d)), "/tmp", "/var/tmp"]


def _path_prefixes() -> list[tuple[str, str]]:
    import workbench

    pairs: list[tuple[str, str]] = []
    for p in sys.path:
        if p.rstrip("/").endswith(("site-packages", "dist-packages")):
            pairs.append((p.rstrip("/"), "<site-packages>"))
    pkg_root = Path(workbench.__file__).resolve().parent.parent
    pairs += [
        (str(pkg_root), "<workbench>"),
        (sys.prefix, "<python>"), (sys.base_prefix, "<python>"), (sys.exec_prefix, "<python>"),
        *((d, "<tmp>") for d in _temp_dirs()),
        (str(Path.home()), "<home>"), (os.getcwd(), "<cwd>"),
    ]
    for p, tag in list(pairs):
        real = os.path.realpath(p)
        if real != p:
            pairs.append((real, tag))
    # Longest first, so /x/.venv/lib/.../site-packages wins over /x; never "/" alone.
    seen, out = set(), []
    for p, tag in sorted(pairs, key=lambda pt: -len(pt[0])):
        p = p.rstrip("/")
        if len(p) > 1 and p not in seen:
            seen.add(p)
            out.append((p, tag))
    return out


def scrub(value: Any, prefixes: list[tuple[str, str]] | None = None) -> Any:
    """``value`` with every machine path prefix replaced by its placeholder (recursively)."""
    prefixes = _path_prefixes() if prefixes is None else prefixes
    if isinstance(value, str):
        for p, tag in prefixes:
            if p in value:
                value = re.sub(re.escape(p) + r"(?=$|[/\\\s'\",:;)\]])", tag, value)
        return value
    if isinstance(value, dict):
        return {scrub(k, prefixes): scrub(v, prefixes) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(scrub(v, prefixes) for v in value)
    return value


def portable(rec: RunRecord) -> RunRecord:
    """A copy of ``rec`` with machine paths replaced by placeholders: what a bundle stores."""
    prefixes = _path_prefixes()
    tables = {name: _scrub_frame(df, prefixes) for name, df in _tables(rec).items()}
    return dataclasses.replace(rec, manifest=scrub(jsonable(rec.manifest), prefixes),
                               notes=scrub(jsonable(rec.notes), prefixes), **tables)


def _scrub_frame(df: pd.DataFrame, prefixes: list[tuple[str, str]]) -> pd.DataFrame:
    df = df.copy()
    for c in df.columns:
        if df[c].dtype == object or pd.api.types.is_string_dtype(df[c]):
            df[c] = [scrub(v, prefixes) if isinstance(v, (str, list, dict)) else v for v in df[c]]
    return df


# -- writing -----------------------------------------------------------------------------
def _parquet_bytes(df: pd.DataFrame) -> tuple[bytes, list[str]]:
    """Parquet of ``df``; object columns pyarrow cannot type are stored as JSON text."""
    import pyarrow as pa

    df = df.reset_index(drop=True).copy()
    df.columns = [str(c) for c in df.columns]
    json_cols = []
    for c in df.columns:
        if df[c].dtype != object:
            continue
        vals = [v for v in df[c] if v is not None and v is not pd.NA]
        if vals and all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            df[c] = df[c].astype("Int64")  # e.g. a findings 'rank' column of ints and None
            continue
        try:
            pa.array(df[c].tolist(), from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError, OverflowError):
            df[c] = [None if v is None else json.dumps(_plain(v), default=str) for v in df[c]]
            json_cols.append(c)
    buf = io.BytesIO()
    df.to_parquet(buf, engine="pyarrow", index=False)
    return buf.getvalue(), json_cols


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return v.tolist()
    return v


def _findings_or_none(rec: RunRecord) -> pd.DataFrame | None:
    try:
        return rec.findings()
    except FINDINGS_FAULTS:  # a record without the columns the detectors need still saves
        return None


def save(obj: Any, path: str | os.PathLike) -> Path:
    """Write a bundle (one zip file) for a Session, Comparison, RunRecord(s) or Bundle.

    Returns the path written. A path without a suffix gets ``.wbundle``. The file appears
    under its name only once complete.
    """
    records = as_records(obj)
    if not records:
        raise BundleError("nothing to save: no runs")
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(SUFFIX)
    if path.is_dir():
        raise BundleError(f"{path} is a directory; give a file name such as {path / 'run.wbundle'}")
    members: dict[str, bytes] = {}
    runs = []
    for i, rec in enumerate(records):
        rec = portable(rec)
        tables = dict(_tables(rec))
        found = _findings_or_none(rec)
        if found is not None:
            tables["findings"] = found
        entry: dict[str, Any] = {"manifest": rec.manifest, "notes": rec.notes, "tables": {}}
        for name, df in tables.items():
            data, json_cols = _parquet_bytes(df)
            member = f"runs/{i}/{name}.parquet"
            members[member] = data
            entry["tables"][name] = {"file": member, "rows": len(df), "sha256": hashlib.sha256(data).hexdigest(),
                                     "json_columns": json_cols}
        runs.append(entry)
    import workbench

    manifest = {
        "format": FORMAT, "schema": BUNDLE_SCHEMA, "record_schema": SCHEMA_VERSION,
        "created_at": time.time(),
        "created_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "writer": {"workbench": workbench.__version__, "python": platform.python_version()},
        "scenario": records[0].manifest.get("scenario"),
        "runs": runs,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    written = False
    try:
        with os.fdopen(fd, "wb") as fh:
            with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_DEFLATED) as zf:
                zf.writestr(MANIFEST, json.dumps(manifest, indent=1, allow_nan=False))
                for name, data in members.items():
                    zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data,
                                compress_type=zipfile.ZIP_STORED)  # Parquet is compressed already
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a bundle is for sharing
        tmp.replace(path)
        written = True
    finally:
        if not written:  # whatever stopped the write (a full disk, Ctrl-C): no temporary left behind
            tmp.unlink(missing_ok=True)
    return path


def unpack(path: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """Unpack a bundle file into a directory (which ``load`` also reads), validating it first."""
    load(path)
    directory = Path(directory)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent if directory.parent else None))
    unpacked = False
    try:
        with zipfile.ZipFile(path) as zf:
            for name in zf.namelist():
                target = (tmp / name).resolve()
                if not str(target).startswith(str(tmp.resolve())):
                    raise BundleError(f"{path}: member {name!r} escapes the bundle")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(name))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.replace(directory)
        unpacked = True
    finally:
        if not unpacked:  # whatever stopped it (an escaping member, a full disk, Ctrl-C): no half-unpacked dir
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


# -- reading -----------------------------------------------------------------------------
class _Reader:
    def __init__(self, path: Path):
        self.path = path
        self.zip: zipfile.ZipFile | None = None
        if path.is_dir():
            return
        try:
            self.zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile as exc:
            raise BundleError(f"{path}: not a workbench bundle, or truncated ({exc})") from None

    def read(self, name: str) -> bytes:
        if self.zip is None:
            f = self.path / name
            if not f.is_file():
                raise BundleError(f"{self.path}: {name} is missing")
            if f.stat().st_size > MAX_MEMBER_BYTES:
                raise BundleError(f"{self.path}: {name} is implausibly large")
            return f.read_bytes()
        try:
            info = self.zip.getinfo(name)
        except KeyError:
            raise BundleError(f"{self.path}: {name} is missing from the bundle") from None
        if info.file_size > MAX_MEMBER_BYTES:
            raise BundleError(f"{self.path}: {name} is implausibly large ({info.file_size} bytes): corrupt")
        return self.zip.read(name)

    def close(self) -> None:
        if self.zip is not None:
            self.zip.close()


def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise BundleError(f"{path}: corrupt manifest: {what}")


def _check_manifest(m: Any, path: Path) -> None:
    _need(isinstance(m, dict), path, "not a JSON object")
    if m.get("format") != FORMAT:
        raise BundleError(f"{path}: not a workbench bundle (format {m.get('format')!r})")
    schema = m.get("schema")
    _need(isinstance(schema, int) and not isinstance(schema, bool), path, "'schema' is not an integer")
    if schema > BUNDLE_SCHEMA:
        raise BundleError(f"{path}: written by a newer workbench (bundle schema {schema}, this one reads up to "
                          f"{BUNDLE_SCHEMA}); upgrade the workbench to open it")
    _need(schema >= 1, path, f"'schema' {schema} is not a valid version")
    runs = m.get("runs")
    _need(isinstance(runs, list) and len(runs) > 0, path, "'runs' is not a non-empty list")
    for i, run in enumerate(runs):
        _need(isinstance(run, dict), path, f"run {i} is not an object")
        rm = run.get("manifest")
        _need(isinstance(rm, dict), path, f"run {i} has no manifest object")
        rschema = rm.get("schema", 1)
        _need(isinstance(rschema, int) and not isinstance(rschema, bool), path, f"run {i} 'schema' is not an integer")
        if rschema > SCHEMA_VERSION:
            raise BundleError(f"{path}: run {i} was recorded by a newer workbench (record schema {rschema}, "
                              f"this one reads up to {SCHEMA_VERSION}); upgrade the workbench to open it")
        _need(isinstance(rm.get("scenario"), str), path, f"run {i} 'scenario' is not a string")
        _need(rm.get("fix") is None or isinstance(rm.get("fix"), str), path, f"run {i} 'fix' is not a string")
        for key in ("steps", "steps_run"):
            v = rm.get(key, [])
            _need(isinstance(v, list) and all(isinstance(s, str) for s in v), path,
                  f"run {i} {key!r} is not a list of step names")
        for key in ("params", "fixes", "devices", "versions"):
            _need(isinstance(rm.get(key, {}), dict), path, f"run {i} {key!r} is not an object")
        _check_run_fields(rm, path, i)
        notes = run.get("notes", [])
        _need(isinstance(notes, list) and all(isinstance(n, dict) for n in notes), path,
              f"run {i} 'notes' is not a list of objects")
        tables = run.get("tables")
        _need(isinstance(tables, dict), path, f"run {i} 'tables' is not an object")
        for t in REQUIRED:
            _need(t in tables, path, f"run {i} has no {t!r} table")
        for t, spec in tables.items():
            _need(isinstance(spec, dict), path, f"run {i} table {t!r} is not an object")
            _need(isinstance(spec.get("file"), str) and spec["file"].startswith("runs/")
                  and ".." not in spec["file"], path, f"run {i} table {t!r} has no valid file name")
            _need(isinstance(spec.get("sha256"), str) and len(spec["sha256"]) == 64, path,
                  f"run {i} table {t!r} has no sha256")
            _need(isinstance(spec.get("rows"), int) and not isinstance(spec.get("rows"), bool)
                  and spec["rows"] >= 0, path, f"run {i} table {t!r} 'rows' is not a count")
            jc = spec.get("json_columns", [])
            _need(isinstance(jc, list) and all(isinstance(c, str) for c in jc), path,
                  f"run {i} table {t!r} 'json_columns' is not a list of names")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rank_key(k: Any, ranks: int | None) -> bool:
    """A rank as the manifest spells it (an int, or its decimal text as a JSON key), within the world."""
    if isinstance(k, str):
        if not k.isdigit() or len(k) > 6:
            return False
        k = int(k)
    return _is_int(k) and k >= 0 and (ranks is None or k < ranks)


def _check_run_fields(rm: dict[str, Any], path: Path, i: int) -> None:
    """Each field a run's manifest carries, against the type and range it describes: the views and
    ``rerun`` read them without further checks, so a crafted value must stop here, in one line."""
    ranks = rm.get("ranks")
    _need(ranks is None or (_is_int(ranks) and 1 <= ranks <= MAX_RANKS), path,
          f"run {i} 'ranks' is {str(ranks)[:40]!r}, not a world size from 1 to {MAX_RANKS}")
    for key in ("title", "incident", "backend"):
        _need(rm.get(key) is None or isinstance(rm[key], str), path, f"run {i} {key!r} is not a string")
    _need(rm.get("poison") is None or isinstance(rm["poison"], bool), path, f"run {i} 'poison' is not true/false")
    t = rm.get("timeout_s")
    _need(t is None or (_is_number(t) and t > 0), path, f"run {i} 'timeout_s' is not a positive number of seconds")
    for key in ("started_at", "saved_at"):
        _need(rm.get(key) is None or _is_number(rm[key]), path, f"run {i} {key!r} is not a time")
    seed = rm.get("seed")
    _need(seed is None or (_is_int(seed) and abs(seed) < 2**64), path, f"run {i} 'seed' is not a 64-bit integer")
    devices = rm.get("devices", {})
    _need(all(_rank_key(k, ranks) for k in devices), path,
          f"run {i} 'devices' names a rank outside 0..{(ranks or 1) - 1}")
    # A run records every rank's device: a world larger than its devices is a number nothing backs.
    _need(ranks is None or len(devices) == ranks, path,
          f"run {i} 'ranks' is {ranks} but 'devices' names {len(devices)} rank(s)")
    elapsed = rm.get("elapsed", [])
    _need(isinstance(elapsed, list) and len(elapsed) <= len(rm.get("steps_run", [])) and all(
        isinstance(e, dict) and all(_rank_key(k, ranks) and _is_number(v) for k, v in e.items()) for e in elapsed),
        path, f"run {i} 'elapsed' is not one {{rank: seconds}} object per step run")
    hangs = rm.get("hangs", [])
    _need(isinstance(hangs, list) and all(_valid_hang(h, ranks) for h in hangs), path,
          f"run {i} 'hangs' is not a list of hang records over ranks 0..{(ranks or 1) - 1}")


def _valid_hang(h: Any, ranks: int | None) -> bool:
    if not isinstance(h, dict) or not isinstance(h.get("step", ""), (str, type(None))):
        return False
    for key in ("stuck", "finished", "dead"):
        v = h.get(key, [])
        if not isinstance(v, (list, dict)) or not all(_rank_key(r, ranks) for r in v):
            return False
    return all(isinstance(h.get(k, {}), (dict, type(None))) for k in ("divergence",))


def _check_rank_columns(tables: dict[str, pd.DataFrame], ranks: int | None, path: Path, i: int) -> None:
    """Every rank a table names is a whole number inside the run's world (``ranks`` in its manifest)."""
    for t in RANK_TABLES:
        df = tables.get(t)
        if df is None or "rank" not in df.columns or not len(df):
            continue
        col = pd.to_numeric(df["rank"], errors="coerce")
        bad = col.isna() & df["rank"].notna() | col.notna() & ((col < 0) | (col % 1 != 0)
                                                                | (col >= (ranks or MAX_RANKS)))
        if bad.any():
            v = df["rank"][bad].iloc[0]
            raise BundleError(f"{path}: run {i} table {t!r} names rank {str(v)[:40]}, outside the run's "
                              f"{ranks or MAX_RANKS} ranks")


def _restore(v: Any) -> Any:
    """Parquet list cells come back as numpy arrays: make them the lists the views expect."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)) and getattr(v, "ndim", 0) >= 1:
        return v.tolist()
    return v


def _read_table(reader: _Reader, spec: dict[str, Any], where: str) -> pd.DataFrame:
    import pyarrow.parquet as pq

    data = reader.read(spec["file"])
    if hashlib.sha256(data).hexdigest() != spec["sha256"]:
        raise BundleError(f"{reader.path}: {spec['file']} is corrupt (checksum mismatch)")
    meta = pq.ParquetFile(io.BytesIO(data)).metadata  # what decoding would cost, before paying it
    size = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    if meta.num_rows != spec["rows"] or meta.num_rows > MAX_TABLE_ROWS or size > MAX_TABLE_BYTES:
        raise BundleError(f"{reader.path}: {where} declares {meta.num_rows} rows ({size} bytes decoded), the "
                          f"manifest says {spec['rows']} (at most {MAX_TABLE_ROWS} rows, {MAX_TABLE_BYTES} bytes)")
    df = pq.read_table(io.BytesIO(data)).to_pandas()
    if len(df) != spec["rows"]:
        raise BundleError(f"{reader.path}: {where} has {len(df)} rows, the manifest says {spec['rows']}")
    for c in df.columns:
        if df[c].dtype == object:
            df[c] = [_restore(v) for v in df[c]]
    for c in spec.get("json_columns", []):
        if c in df.columns:
            df[c] = [None if v is None else json.loads(v) for v in df[c]]
    return df


def _load(path: Path) -> Bundle:
    if not path.exists():
        raise BundleError(f"no bundle at {path}")
    reader = _Reader(path)
    try:
        raw = reader.read(MANIFEST)
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BundleError(f"{path}: corrupt manifest ({type(exc).__name__}: {exc})") from None
        _check_manifest(manifest, path)
        field_names = {f.name for f in dataclasses.fields(RunRecord)}
        records, recorded = [], []
        for i, run in enumerate(manifest["runs"]):
            tables = {t: _read_table(reader, spec, f"run {i} table {t!r}") for t, spec in run["tables"].items()}
            for t, cols in REQUIRED.items():
                missing = [c for c in cols if c not in tables[t].columns]
                if missing and len(tables[t]):
                    raise BundleError(f"{path}: run {i} table {t!r} lacks columns {', '.join(missing)}")
            _check_rank_columns(tables, run["manifest"].get("ranks"), path, i)
            kwargs = {t: df for t, df in tables.items() if t in field_names and t not in ("manifest", "notes")}
            records.append(RunRecord(manifest=run["manifest"], notes=run.get("notes", []), **kwargs))
            recorded.append(tables.get("findings"))
    finally:
        reader.close()
    return Bundle(records, manifest, recorded, source=path.name)


def load(path: str | os.PathLike) -> Bundle:
    """Open a bundle file (or an unpacked bundle directory, or a directory of per-rank shards that
    ``workbench.job.capture`` wrote); one ``BundleError`` line if it is bad."""
    path = Path(path)
    from workbench.postmortem import shards

    if shards.is_shard_dir(path):
        rec, problems = shards.read_checked(path)
        b = Bundle([rec], {"format": FORMAT, "source": "shards", "scenario": rec.manifest["scenario"],
                           "problems": problems, "runs": []}, source=path.name)
        b.problems = problems  # a missing rank, another job's shard: lines, and the rest opens
        return b
    try:
        return _load(path)
    except BundleError:
        raise
    except damage_faults() as exc:
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise BundleError(f"{path}: corrupt bundle ({msg})") from None
