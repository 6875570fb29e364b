"""``workbench list | run | report | rerun | up | down | status | frtrace | lab | job``: the catalogue headless, warm
ranks, one clear line on bad input."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError


def _parse_set(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise WorkbenchError(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def positive_seconds(text: str) -> float:
    """argparse type of --timeout: a bad value fails in argparse's one line, before any engine starts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def cmd_list(args: argparse.Namespace) -> int:
    from workbench import scenarios

    for name in scenarios.names():
        sc = scenarios.get(name)
        print(f"{name:34s} {sc.title}  [ranks: {sc.meshes}]")
        for fix, doc in sc.fixes.items():
            first = re.split(r"(?<=[a-z0-9)`])\.\s+(?=[A-Z(])", doc, maxsplit=1)[0].rstrip(".")
            warn = "NON-FIX (kept to show why): " if fix in sc.non_fixes else ""
            print(f"    --fix {fix:28s} {warn}{first}")
    return 0


def run_json(session: Any) -> dict[str, Any]:
    """The CLI's --json shape: frames with per-rank errors and tensor rows, outputs by name."""
    from workbench.analysis.frames import records

    outputs: dict[str, list] = {}
    if session.frames:
        for row in records(session.frames[-1].outputs):
            outputs.setdefault(row["name"], []).append(row)
    return {
        "scenario": session.scenario.name, "fix": session.fix, "backend": session.cluster.backend,
        "ranks": session.cluster.world_size, "poison": session.poison, "params": session.params,
        "diagnosis": session.diagnose().to_dict(),
        "frames": [f.to_dict() for f in session.frames], "outputs": outputs,
    }


def status_summary(tensors: Any) -> Any:
    """One row per (rank, status) that is not ok: how many tensors, a few of their names."""
    import pandas as pd

    from workbench.analysis.findings import status
    from workbench.analysis.frames import shorten

    st = status(tensors)
    st = st[~st["status"].isin(["ok", "meta", "sharded"])]
    short = shorten(list(dict.fromkeys(tensors["name"])))
    rows = [{"rank": int(r), "status": s, "tensors": len(g),
             "names": ", ".join(short[n] for n in list(g["name"])[:3]) + (" ..." if len(g) > 3 else "")}
            for (r, s), g in st.groupby(["rank", "status"], sort=True)]
    return pd.DataFrame(rows, columns=["rank", "status", "tensors", "names"])


def print_summary(session: Any, record: Any = None) -> None:
    """The diagnosis first, then one line per step, then what is wrong per rank, grouped (not one row per
    tensor), then the outputs. ``record``: the session's record when the caller already took it (its tables
    are the run's slowest thing to build after the steps)."""
    import pandas as pd

    from workbench.analysis import diagnosis
    from workbench.analysis.frames import last_step

    label = f"fix {session.fix}" if session.fix else "bug path"
    print(f"\n== {session.scenario.name} · {label} · {session.cluster.world_size} ranks "
          f"· {session.cluster.backend} · poison {'on' if session.poison else 'off'}")
    d = session.diagnose() if record is None else diagnosis.diagnose(record)
    print(f"\n  diagnosis ({d.mechanism}): {d.sentence}\n")
    for f in session.frames:
        errs = "; ".join(f"rank {r}: {m[:110]}" for r, m in f.rank_errors.items())
        times = " ".join(f"r{r}={t:.2f}s" for r, t in sorted(f.elapsed.items()))
        print(f"  step {f.index} {f.step:14s} {times}  {errs}")
    last = session.frames[-1] if session.frames else None
    if last is None or last.tensors.empty:
        return
    summary = status_summary(last.tensors)
    with pd.option_context("display.width", 200, "display.max_colwidth", 90, "display.max_rows", 40):
        print(f"\n  tensors not ok after '{last.step}' ({last.tensors['name'].nunique()} tensors per rank):")
        print(summary.to_string(index=False) if len(summary) else "  none")
        out = session.outputs if record is None else record.outputs  # the record's: no second stacking
        if len(out):
            out = last_step(out)
            print("\n  outputs:")
            print(out[["rank", "name", "dtype", "shape", "nan", "ref_max_abs_diff", "fingerprint"]]
                  .to_string(index=False))


def check_output(path: str | None, flag: str, suffix: str = "") -> None:
    """Fail before any engine starts when an output cannot be written: a directory, a parent
    that is a file, or a folder this user cannot write (a missing parent is made later)."""
    if not path:
        return
    p = Path(path)
    if suffix and not p.suffix:
        p = p.with_suffix(suffix)  # what bundle.save writes
    if p.is_dir():
        raise WorkbenchError(f"{flag} {path}: is a directory; give a file name")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise WorkbenchError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise WorkbenchError(f"{flag} {path}: not writable")


def distinct_outputs(args: argparse.Namespace) -> None:
    """Two outputs naming one file would keep only the last written (rc 0): refuse before engines start."""
    seen: dict[str, str] = {}
    for flag, path in (("--json", args.json), ("--bundle", args.bundle), ("--report", args.report)):
        if not path:
            continue
        p = Path(path)
        if flag == "--bundle" and not p.suffix:  # what bundle.save writes (imported only when a bundle is asked)
            from workbench.postmortem.bundle import SUFFIX

            p = p.with_suffix(SUFFIX)
        key = os.path.realpath(p)
        if key in seen:
            raise WorkbenchError(f"{flag} {path}: the same file as {seen[key]}; give each output its own name")
        seen[key] = f"{flag} {path}"


def write_outputs(runs: list[Any], records: list[Any], args: argparse.Namespace) -> list[str]:
    """Write --json, --bundle and --report, each on its own: one that fails does not lose the
    others. Returns one line per output that could not be written."""
    errors: list[str] = []
    if not (args.json or args.bundle or args.report):  # no output: the report's plotly stack stays unimported
        return errors
    from workbench.analysis.frames import jsonable
    from workbench.postmortem import bundle, report

    saved = None
    if args.json:
        try:
            doc = run_json(runs[0])
            doc["fixes"] = [run_json(s) for s in runs[1:]]
            # strict JSON (a --set x=nan param included), machine paths scrubbed as in bundles, written atomically
            report.write_atomic(args.json, json.dumps(bundle.scrub(jsonable(doc)), indent=1, allow_nan=False))
            print(f"json: {args.json}")
        except (OSError, ValueError, WorkbenchError) as exc:
            errors.append(f"--json {args.json}: {exc}")
    if args.bundle:
        try:
            saved = bundle.save(records, args.bundle)
            print(f"bundle: {saved}")
        except (OSError, ValueError, WorkbenchError) as exc:
            errors.append(f"--bundle {args.bundle}: {exc}")
    if args.report:
        # The same path as `workbench report BUNDLE`: records -> bundle -> loaded -> page.
        import tempfile

        try:
            with tempfile.TemporaryDirectory() as d:
                src = saved or bundle.save(records, Path(d) / "run.wbundle")
                print(f"report: {report_from_bundle(src, args.report)}")
        except (OSError, ValueError, WorkbenchError) as exc:
            errors.append(f"--report {args.report}: {exc}")
    return errors


class Interrupted(KeyboardInterrupt):
    """Ctrl-C/SIGTERM, with what happened to the ranks (an attached cluster's stay up)."""


def release_attached(cluster: Any, where: str) -> Interrupted:
    """An interrupted run on warm ranks: abort their group through each rank's control thread, so a rank blocked
    in a collective returns now instead of at the collective timeout (the next run waited for it, silently)."""
    try:
        for cmd in ("mark", "abort"):  # every rank marked first, as recover() does
            replies = [cluster.control(r, cmd) for r in range(cluster.world_size)]
        done = all(r.get("aborted") for r in replies)
    except Exception:  # on the way out of a Ctrl-C: whatever the ranks did, the line says they were not all reached
        done = False
    return Interrupted(f"the ranks of cluster {where!r} stay up; " + (
        "their process group was aborted, so a collective the step was blocked in returns now (a step still "
        "running Python keeps its rank busy until it ends)" if done else
        "they could not all be reached, and may still be running the interrupted step")
        + f"; `workbench down --profile {where}` stops them")


def remove_session_dirs(runs: list[Any]) -> None:
    """The client's ledger dir and this host's rank work dirs of each session (what ``Session.close`` removes)."""
    import glob
    import shutil
    import tempfile

    for s in runs:
        shutil.rmtree(s.ledger_dir, ignore_errors=True)
        for d in glob.glob(os.path.join(tempfile.gettempdir(), f"wb-{glob.escape(s.id)}-r*")):
            shutil.rmtree(d, ignore_errors=True)


def cmd_run(args: argparse.Namespace) -> int:
    from workbench import scenarios

    sc = scenarios.resolve(args.scenario)
    sc.check_fix(args.fix)
    params = sc.resolve_params(_parse_set(args.set))
    check_output(args.json, "--json")
    check_output(args.bundle, "--bundle", ".wbundle")
    check_output(args.report, "--report")
    if args.ranks is not None and args.ranks >= 1:  # below 1: the engines' own one-line refusal
        sc.check_ranks(args.ranks, params)
    distinct_outputs(args)
    fixes = list(sc.fixes) if args.compare else []
    t0 = time.perf_counter()
    runs: list[Any] = []
    records: list[Any] = []
    try:
        with ranks_for(args) as cluster:
            cluster.progress = not args.no_progress  # a long step's status line on stderr (rewritten on a terminal)
            print(f"{cluster}: engines {cluster.start_s:.1f}s, imports {cluster.imports_s:.1f}s, "
                  f"process group {cluster.group_s:.2f}s")
            try:
                for fix in [args.fix, *(f for f in fixes if f != args.fix)]:
                    runs.append(cluster.session(sc, fix=fix, poison=not args.no_poison, **params))
                    runs[-1].run()
                    records.append(runs[-1].record())
                    print_summary(runs[-1], records[-1])
                    runs[-1].close()  # free the ranks' models before the next run; the frames stay
            except KeyboardInterrupt:
                if args.cluster:
                    raise release_attached(cluster, args.cluster) from None
                raise
    except KeyboardInterrupt as exc:
        if args.cluster and not isinstance(exc, Interrupted):  # between steps: nothing to release, nothing stopped
            raise Interrupted(f"the ranks of cluster {args.cluster!r} stay up; `workbench down --profile "
                              f"{args.cluster}` stops them") from None
        raise
    finally:  # failed or interrupted: the sessions' local temp dirs go too (no call to ranks that may be stuck)
        remove_session_dirs(runs)
    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    errors = write_outputs(runs, records, args)
    failed = [f"{s.fix or 'bug path'}: {f.step}" for s in runs for f in s.frames if not f.ok]
    if failed:  # a run whose steps raised, hung or lost a rank is not a success, whatever it printed
        errors.append(f"{len(failed)} step(s) failed ({', '.join(failed[:6])}); see the steps above")
    for line in errors:
        print(f"workbench: error: {line}", file=sys.stderr)
    return 1 if errors else 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """The bug path (or --fix) over world sizes x parameter values: where the bug shows, where it is silent."""
    import workbench as wb

    try:
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        raise WorkbenchError(f"--ranks {args.ranks!r}: expected comma-separated integers, e.g. 2,4,8") from None
    grid: dict[str, list[str]] = {}
    for item in args.set:
        key, sep, values = item.partition("=")
        if not sep or not key.strip():
            raise WorkbenchError(f"--set {item!r}: expected KEY=V1,V2,...")
        grid[key.strip()] = [v for v in values.split(",") if v != ""]
    check_output(args.json, "--json")
    check_output(args.html, "--html")
    result = wb.sweep(args.scenario, ranks, grid, fix=args.fix, poison=not args.no_poison, backend=args.backend,
                      timeout=args.timeout, progress=lambda line: print(line, file=sys.stderr))
    print(result)
    if args.json:
        Path(args.json).write_text(result.table.to_json(orient="records", indent=1))
    if args.html:
        from workbench.viz.sweep import sweep_view

        sweep_view(result.table, title=result.where()).write_html(args.html)
        print(f"html: {args.html}")
    return 0


def report_from_bundle(path: str | Path, out: str | Path) -> Path:
    from workbench.postmortem import bundle, report

    return report.write(bundle.load(path), out)


def cmd_report(args: argparse.Namespace) -> int:
    if args.bundle.startswith(("http://", "https://")):
        args.output = args.output or "live-job.html"
        args.bundle = _fetch_live(args.bundle.split(","))
    out = args.output or Path(args.bundle.rstrip("/")).with_suffix(".html").name
    check_output(str(out), "-o")
    src, dst = os.path.realpath(args.bundle), os.path.realpath(out)
    if dst == src or dst.startswith(src.rstrip(os.sep) + os.sep):
        raise WorkbenchError(f"-o {out}: that is the bundle itself; the report would overwrite it")
    from workbench.postmortem import shards

    if not shards.is_shard_dir(args.bundle):
        if args.merge:
            raise WorkbenchError(f"--bundle {args.merge}: {args.bundle} is a bundle already; --bundle merges a "
                                 "directory of per-rank shards")
        print(f"report: {report_from_bundle(args.bundle, out)}")
        return 0
    # A directory of per-rank shards (workbench.job.capture): what did not fit, the story, the page.
    from workbench.postmortem import bundle, report

    if args.merge:
        check_output(args.merge, "--bundle")
    b = bundle.load(args.bundle)  # each problem with the shards is one line on stderr already (its log)
    print(f"diagnosis: {b.bug.diagnose().sentence}")
    print(f"report: {report.write(b, out)}")
    if args.merge:
        print(f"bundle: {bundle.save(b, args.merge)}")
    return 0


def _fetch_live(urls: list[str]) -> str:
    """A running job's shards through its ranks' debug-server workers (``workbench.job``'s handler), into
    a temporary directory of shards; a worker that does not answer is one line."""
    import atexit
    import shutil
    import tempfile

    from workbench.job import fetch

    where, missed = fetch(urls, tempfile.mkdtemp(prefix="wb-live-job-"))
    atexit.register(shutil.rmtree, where, True)  # the page and a --bundle hold what was read
    for line in missed:
        print(f"debug server: no answer from {line}", file=sys.stderr)
    if len(missed) == len(urls):
        raise WorkbenchError(f"no debug-server worker answered ({len(urls)} asked)")
    return str(where)


def cmd_rerun(args: argparse.Namespace) -> int:
    """Rerun every run of a bundle as recorded and say, per run: reproduced exactly, the same story within
    rounding (another machine's kernels), or where it differs. Exit 1 when any differs."""
    from workbench.postmortem import bundle, rerun

    b = bundle.load(args.bundle)
    ranks = max(int(r.manifest.get("ranks") or 0) for r in b)
    limit = args.max_ranks or 4 * (os.cpu_count() or 1)
    for rec in b:
        rerun.check(rec)
    if ranks > limit:
        raise WorkbenchError(f"the bundle was recorded on {ranks} ranks; this machine starts at most {limit} "
                             "(--max-ranks to raise it)")
    m = b[0].manifest
    backend = m.get("backend") or "auto" if args.backend == "recorded" else args.backend
    args.ranks, args.backend, args.timeout = ranks, backend, float(m.get("timeout_s") or 60.0)
    with ranks_for(args) as cluster:
        results = b.rerun(cluster, strict=args.strict)
    for r in results:
        print(r.message)
    return 0 if all(r.reproduced for r in results) else 1


def cmd_diff(args: argparse.Namespace) -> int:
    """Two runs of a job (captures, bundles, or one of each): where they first part, in one sentence; with -o,
    the HTML page (the sentence, points x tensors coloured by the first kind of difference). Exit 1 when
    they part (or share no points), 0 when they agree (bytes equal, or within rounding)."""
    from workbench.postmortem.diff import diff

    if args.output:
        check_output(args.output, "-o")
    d = diff(args.a, args.b, labels=tuple(args.labels.split(",", 1)) if args.labels else None)
    print(d.sentence)
    if args.output:
        print(f"report: {d.to_html(args.output) and args.output}")
    return 0 if d.same else 1


def add_diff(sub: Any) -> None:
    dp = sub.add_parser("diff", help="two runs of a job (captures or bundles): where they first part, in one sentence")
    dp.add_argument("a", help="the first run (the good one): a directory of shards, a .wbundle or a bundle directory "
                    "(BUNDLE@FIX: that fix's run)")
    dp.add_argument("b", help="the second run (the bad one)")
    dp.add_argument("-o", "--output", default=None, metavar="FILE", help="also write the HTML page here")
    dp.add_argument("--labels", default=None, metavar="A,B", help="what the sentence calls them (default: the "
                    "directories' names)")
    dp.set_defaults(fn=cmd_diff)


def ranks_for(args: argparse.Namespace) -> Any:
    """Fresh engines, or with ``--cluster P`` the warm ones of a running cluster (left up on exit)."""
    import workbench as wb

    if getattr(args, "cluster", None):
        return wb.connect(args.cluster, args.cluster_id, ranks=args.ranks, backend=args.backend, timeout=args.timeout)
    return wb.start(ranks=2 if args.ranks is None else args.ranks, backend=args.backend, timeout=args.timeout)


def cmd_up(args: argparse.Namespace) -> int:
    from workbench.live import registry

    doc = registry.up(args.ranks, args.profile, args.cluster_id, backend=args.backend)
    warm = f"warm: imports and first calls {doc['warm_s']:.1f}s" if doc.get("warm_s") is not None else \
        "still warming: the first run may wait for the ranks' imports"
    print(f"cluster {doc['profile']!r}: {doc['ranks']} ranks ({doc['backend']}) up in {doc['seconds']:.1f}s ({warm}); "
          f"`workbench run SCENARIO --cluster {doc['profile']}` attaches, `workbench down --profile "
          f"{doc['profile']}` stops it")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from workbench.live import registry

    n = registry.down(args.profile, args.cluster_id)
    print(f"cluster {args.profile or 'default'!r} stopped ({n} processes)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from workbench.live import registry

    rows = registry.running(args.profile)
    if not rows:
        print("no clusters recorded (`workbench up --ranks N` starts one)")
    for r in rows:
        age = "-" if r["age_s"] is None else f"{r['age_s'] / 60:.1f} min"
        print(f"{r['cluster']:40s} {'running' if r['running'] else 'stopped':8s} ranks {r['ranks'] or '?'}  "
              f"backend {r['backend']}  age {age}")
    return 0


def cmd_frtrace(args: argparse.Namespace) -> int:
    """Read a job's Flight Recorder dumps as a ledger: who is where, and the first divergence."""
    import json

    from workbench.analysis import collectives

    check_output(args.html, "--html")
    ledger = collectives.from_flight_recorder(args.dir, args.prefix)
    ranks = sorted({int(r) for r in ledger["rank"]})
    backends = sorted({str(v).split(":")[0] for v in ledger["c10d_op"].dropna()})
    print(f"{args.dir}: {len(ledger)} calls from {len(ranks)} ranks ({', '.join(backends) or '?'})")
    members = {int(r) for v in ledger["group_ranks"].dropna().unique() for r in json.loads(v)}
    if members - set(ranks):
        print(f"  no dump from rank(s) {sorted(members - set(ranks))}: a call they 'never issued' may only be "
              "missing from the dumps")
    if len(ledger):
        for row in collectives.diagnose("flight recorder", ledger, {}, ranks).ranks.itertuples():
            print(f"  rank {row.rank}: {row.status}")
    div = collectives.first_divergence(ledger)
    print(f"first divergence: {div.message}" if div else "no divergence: every rank's calls pair up")
    if args.html:
        from workbench.viz.collectives import swimlane

        swimlane(ledger, title=f"Flight Recorder: {args.dir}").write_html(args.html)
        print(f"html: {args.html}")
    return 1 if div else 0


def _add_cluster_args(p: argparse.ArgumentParser, flag: str) -> None:
    help_ = "profile name or directory of a running cluster (see `workbench up`)"
    p.add_argument(flag, default=None if flag == "--cluster" else "default", metavar="P", help=help_)
    p.add_argument("--cluster-id", default="", help="ipyparallel cluster id within the profile (default: '')")


def cmd_lab(args: argparse.Namespace) -> int:
    nb = Path(__file__).resolve().parent.parent / "notebooks"
    os.execvp(sys.executable, [sys.executable, "-m", "jupyter", "lab", str(nb if nb.is_dir() else Path.cwd())])
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the scenario catalogue and its fixes").set_defaults(fn=cmd_list)
    w = sub.add_parser("sweep", help="the bug path over meshes and parameter values: where the bug shows")
    w.add_argument("scenario", help="catalogue id, or path/to/file.py:object")
    w.add_argument("--ranks", default="2", help="world sizes, comma-separated (default 2)")
    w.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2", help="a parameter's values")
    w.add_argument("--fix", default=None)
    w.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    w.add_argument("--timeout", type=float, default=30.0, help="collective timeout per cell (s)")
    w.add_argument("--no-poison", action="store_true")
    w.add_argument("--json", default=None, help="the table as JSON records")
    w.add_argument("--html", default=None, help="the grid as a figure")
    w.set_defaults(fn=cmd_sweep)
    r = sub.add_parser("run", help="run a scenario end to end on live ranks")
    r.add_argument("scenario", help="catalogue id, or path/to/file.py:object")
    r.add_argument("--ranks", type=int, default=None, help="default 2 (with --cluster: every engine)")
    r.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    r.add_argument("--fix", default=None)
    r.add_argument("--compare", action="store_true", help="also run every fix and put them in the report")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scenario parameter")
    r.add_argument("--timeout", type=positive_seconds, default=60.0, help="collective timeout in seconds")
    r.add_argument("--no-poison", action="store_true", help="leave to_empty memory as the allocator gives it")
    r.add_argument("--no-progress", action="store_true",
                   help="no status line on stderr while a step runs past a second")
    r.add_argument("--report", default=None, metavar="FILE", help="write a self-contained HTML report")
    r.add_argument("--bundle", default=None, metavar="FILE",
                   help="save the run(s) as a postmortem bundle (open with `workbench report` or wb.load)")
    r.add_argument("--json", default=None, metavar="FILE", help="write frames and outputs as JSON")
    _add_cluster_args(r, "--cluster")
    r.set_defaults(fn=cmd_run)
    rp = sub.add_parser("report", help="a self-contained HTML report from a saved bundle (no engines needed)")
    rp.add_argument("bundle", help="a .wbundle file, an unpacked bundle directory, a directory of per-rank "
                    "shards a job wrote (workbench.job.capture), or its ranks' debug-server workers (URL,URL,...)")
    rp.add_argument("-o", "--output", default=None, metavar="FILE", help="HTML file (default: BUNDLE-name.html)")
    rp.add_argument("--bundle", dest="merge", default=None, metavar="FILE",
                    help="a directory of shards (workbench.job.capture): also merge it into this .wbundle")
    rp.set_defaults(fn=cmd_report)
    rr = sub.add_parser("rerun", help="rerun a bundle's runs as recorded and diff them against the recording")
    rr.add_argument("bundle", help="a .wbundle file (or an unpacked bundle directory)")
    rr.add_argument("--backend", default="recorded", choices=["recorded", "auto", "gloo", "nccl"])
    rr.add_argument("--max-ranks", type=int, default=None, help="most ranks to start (default: 4 per CPU core)")
    rr.add_argument("--strict", action="store_true",
                    help="reproduced only when bit-exact (default: the same story, values within rounding)")
    _add_cluster_args(rr, "--cluster")
    rr.set_defaults(fn=cmd_rerun)
    add_diff(sub)
    u = sub.add_parser("up", help="start a cluster in the background and return (warm ranks for --cluster)")
    u.add_argument("--ranks", type=int, required=True)
    u.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    _add_cluster_args(u, "--profile")
    u.set_defaults(fn=cmd_up)
    d = sub.add_parser("down", help="stop a cluster started by `workbench up` or ipcluster; no process left")
    _add_cluster_args(d, "--profile")
    d.set_defaults(fn=cmd_down)
    st = sub.add_parser("status", help="recorded clusters: ranks, backend, age")
    st.add_argument("--profile", default=None, metavar="P", help="one profile (default: every profile)")
    st.set_defaults(fn=cmd_status)
    fr = sub.add_parser("frtrace", help="read a job's Flight Recorder dumps: where each rank is, the first divergence")
    fr.add_argument("dir", help="directory of per-rank dumps (<prefix><rank>, pickle or JSON) or one dump file")
    fr.add_argument("--prefix", default=None, metavar="P", help="dump file name before the rank (default: inferred)")
    fr.add_argument("--html", default=None, metavar="OUT", help="also write the swimlane figure as HTML")
    fr.set_defaults(fn=cmd_frtrace)
    sub.add_parser("lab", help="JupyterLab on the notebooks").set_defaults(fn=cmd_lab)
    add_job_parser(sub)
    return p


def _job_options(j: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from workbench.job import config  # its words: the environment reads what the command line takes

    j.add_argument("--every", type=int, default=None, metavar="N", help="a point every N-th optimizer step; 0: "
                   "the first step only (default: every step on GPUs, the first step only on CPU)")
    j.add_argument("--points", nargs="?", const="", default=None, metavar="NAMES",
                   help="only these automatic points, comma-separated; alone: list them")
    j.add_argument("--attach", default=None, choices=[*config.ATTACH, "off"],
                   help="every rank attachable from a notebook (wb.connect(job=DIR)) once a rank raises (on-error) or "
                   "the ledgers prove a deadlock (on-deadlock); post-mortem: both. Default at a terminal (stdin and "
                   "stderr a TTY, CI unset): post-mortem; a rank that raises prints its traceback at once, then one "
                   "line (who raised, for how long every rank waits, how to attach) and waits; Ctrl-C ends the wait "
                   "and the job fails as it would have. Default for a run nobody watches (no TTY: a batch job, a "
                   "pipe; or CI set): on-deadlock; a raise fails the job at once, as without the wrapper, and a "
                   "proven deadlock is said in one line and ended after --attach-deadline")
    j.add_argument("--attach-deadline", type=positive_seconds, default=600.0, metavar="S",
                   help="seconds a post-mortem attach waits for `cluster.resume()` (default 600)")
    j.add_argument("--hang-after", type=positive_seconds, default=60.0, metavar="S",
                   help="seconds a collective may stay open before the ledgers may call it stuck (default 60): a "
                   "deadlock is proven (and, with the attach, served and ended) that much sooner")
    j.add_argument("--poison", default="to_empty", choices=[m.value for m in config.Poison],
                   help="NaN in what to_empty hands out (default), in every allocation too, or none")
    j.add_argument("--ledger", default="calls", choices=[m.value for m in config.Ledger],
                   help="the collective record: around torch.distributed's calls (default), every op, or none "
                   "(then post mortem on error only)")
    j.add_argument("--site", action="store_true", help="print the site hook's directory (for PYTHONPATH, with "
                   "WORKBENCH_CAPTURE=DIR, where the launcher cannot be wrapped) and exit")
    return j


def add_job_parser(sub: Any) -> None:
    j = sub.add_parser("job", usage="workbench job DIR [options] -- LAUNCHER ARGS...",
                       help="run a launcher (torchrun, srun, accelerate launch) with every rank captured, no line "
                       "of the script changed: `workbench job DIR -- torchrun ... train.py`")
    _job_options(j)
    j.add_argument("rest", nargs=argparse.REMAINDER, metavar="DIR [options] -- LAUNCHER ARGS",
                   help="the capture directory (one shard per rank: `workbench report DIR`), then -- and the command")
    j.set_defaults(fn=cmd_job)


def watched(env: dict[str, str] | None = None, streams: tuple[Any, ...] | None = None) -> bool:
    """Whether someone watches this run: stdin and stderr are a terminal and ``CI`` is not set. A batch job
    (``sbatch``), a pipe, a CI runner: nobody does, so ``workbench job`` does not have a raising job wait for a
    notebook there unless ``--attach`` asks."""
    env = os.environ if env is None else env
    if env.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    for stream in (sys.stdin, sys.stderr) if streams is None else streams:
        try:
            if stream is None or not stream.isatty():
                return False
        except (OSError, ValueError, AttributeError):
            return False
    return True


def cmd_job(args: argparse.Namespace) -> int:
    """Exec the launcher with the site hook on its ``PYTHONPATH`` and the capture's options in its environment:
    from then on its exit status, output and signals are the launcher's own (``workbench/job/hooks.py``)."""
    from workbench.job import config, hooks

    rest = list(args.rest)
    head, command = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    more = _job_options(argparse.ArgumentParser(prog="workbench job", add_help=False))
    more.add_argument("dir", nargs="?")
    try:
        opts = more.parse_args(head, namespace=argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                                     if k not in ("rest", "fn")}))
    except SystemExit:
        raise WorkbenchError(f"workbench job: cannot read {' '.join(head)!r}: DIR [options] -- LAUNCHER ARGS") from None
    args = opts
    package = Path(hooks.__file__).resolve().parent
    if args.site:
        print(package / "site")
        return 0
    if args.points == "" and not command:
        for name, what in hooks.POINTS.items():
            print(f"{name:26s} {what}")
        return 0
    if not args.dir or not command:
        raise WorkbenchError("workbench job needs a directory and a command: workbench job DIR -- torchrun ... "
                             "train.py")
    if args.every is not None and args.every < 0:
        raise WorkbenchError(f"--every takes a number of steps (0: the first only); got {args.every}")
    try:
        names = config.check_points(p.strip() for p in (args.points or "").split(",") if p.strip())
    except ValueError as exc:
        raise WorkbenchError(str(exc)) from None
    asked = args.attach is not None
    if not asked:  # nobody who did not ask for a notebook waits for one unless someone watches the run
        args.attach = "post-mortem" if watched() else "on-deadlock"
    if args.ledger == "off" and args.attach != "off":  # a deadlock is proven from the ledgers: none to read
        if args.attach == "on-deadlock" and asked:
            raise WorkbenchError("--attach on-deadlock reads the ledger: drop --ledger off, or --attach on-error")
        args.attach = "on-error" if args.attach != "on-deadlock" else "off"
    env = dict(os.environ)
    env.pop(config.ENV_PID, None)  # the rank that captures sets it
    job = None
    if not any(k in env for k in (config.ENV_JOB, "SLURM_PROCID")):  # one id every rank reads from its start
        import uuid

        job = f"job-{uuid.uuid4().hex[:12]}"
    env.update(config.CaptureConfig(
        directory=str(Path(args.dir).resolve()), job=job, poison=config.Poison(args.poison),
        ledger=config.Ledger(args.ledger), every=args.every, points=names or tuple(config.POINTS),
        attach=None if args.attach == "off" else args.attach, attach_deadline=args.attach_deadline,
        hang_after=args.hang_after, home=str(package.parent.parent),
        launcher_pid=os.getpid(),  # the launcher's, once exec'd: what the wait line names
    ).to_env())
    env["PYTHONPATH"] = os.pathsep.join([str(package / "site"), *filter(None, [env.get("PYTHONPATH")])])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)  # returns only if it could not start
    except OSError as exc:
        raise WorkbenchError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
    return 127


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the Ctrl-C path: `with wb.start(...)` stops every engine on the way out


class PipeSafe:
    """stdout that outlives its reader: ``workbench run ... | head -1`` must still write the bundle and
    stop the engines. Once the pipe breaks, the rest of the output goes to /dev/null."""

    def __init__(self, stream: Any):
        self.stream, self.broken = stream, False

    def _drop(self) -> None:
        self.broken = True
        try:  # the stream's buffer is flushed again at exit: give it somewhere to go
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._drop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import signal
    import threading

    stdout = sys.stdout
    sys.stdout = PipeSafe(stdout)
    saved = {}
    if threading.current_thread() is threading.main_thread():
        # timeout, CI cancellation and `docker stop` send SIGTERM; a closed terminal SIGHUP
        saved = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return args.fn(args)
    except WorkbenchError as exc:
        print(f"workbench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"workbench: interrupted; {str(exc) or 'engines stopped'}", file=sys.stderr)
        return 130
    finally:
        for sig, handler in saved.items():  # main() called in-process (tests) leaves the caller's handlers
            signal.signal(sig, handler)
        sys.stdout.flush()  # a broken pipe found here goes to /dev/null too, not to "Exception ignored" at exit
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
