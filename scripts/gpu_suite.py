"""Every catalogue scenario, bug path and each fix, on live ranks; one table out.

Meant for a machine with N GPUs (``--backend nccl``, the default when there are GPUs),
runs anywhere (``--backend gloo`` on CPU). Per run it writes flat files into ``--out``:
``<scenario>__<run>.json`` (manifest, final-step status per rank, findings, outputs,
events, notes, timings; strict JSON) and, when ``workbench.postmortem.bundle`` exists, a bundle
beside it. Then ``suite.json`` + ``suite.txt`` (the table) and exit status 0 when every
bug path showed its bug and every fix not marked a non-fix came out clean.

    python scripts/gpu_suite.py --out gpu-out [--ranks 2] [--backend nccl] [--only NAME ...]

Judging a run looks at the state after its last step (earlier steps may legitimately
differ across ranks, e.g. before a cast) plus every rank failure of every step:
- bug observed: any error/warning finding at the last step, or any rank failure;
- fix clean: no error finding at the last step (NaN, Inf, poison, output off the
  reference) and no rank failure anywhere; warnings (content that differs from rank 0,
  which shards and per-rank data do by design) are listed, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _jsonable(v: Any) -> Any:
    import math

    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        try:
            return _jsonable(v.item())
        except Exception:
            return str(v)
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    try:
        import pandas as pd

        if v is pd.NA:
            return None
    except Exception:
        pass
    return str(v)


def _records(df) -> list[dict[str, Any]]:
    return [_jsonable(r) for r in df.to_dict(orient="records")] if df is not None and len(df) else []


def rank_view(session) -> dict[int, str]:
    """What each rank showed after the last step: tensor statuses, output health, failures."""
    from workbench.analysis import findings

    shown: dict[int, list[str]] = {r: [] for r in range(session.cluster.world_size)}
    for f in session.frames:
        for e in f.events.itertuples():
            shown.setdefault(int(e.rank), []).append(f"{f.step}: {e.kind} {e.error}: {str(e.message)[:120]}")
    last = session.last
    if last is not None and len(last.tensors):
        st = findings.status(last.tensors)
        for r, g in st.groupby("rank"):
            counts = g["status"].value_counts()
            bad = {k: int(v) for k, v in counts.items() if k not in ("ok",)}
            part = f"{int(counts.get('ok', 0))}/{len(g)} ok" + (
                "" if not bad else " (" + ", ".join(f"{v} {k}" for k, v in bad.items()) + ")")
            shown.setdefault(int(r), []).append(part)
    if last is not None and len(last.outputs):
        for o in last.outputs.itertuples(index=False):
            bits = []
            if o.nan is not None and o.nan == o.nan and int(o.nan) > 0:
                bits.append(f"{int(o.nan)} NaN")
            diff = getattr(o, "ref_max_abs_diff", None)
            if diff is not None and diff == diff:
                bits.append(f"|d ref|={float(diff):.3g}")
            shown.setdefault(int(o.rank), []).append(f"{o.name}: " + (", ".join(bits) or "finite"))
    return {r: "; ".join(v) for r, v in shown.items()}


def judge(session, record) -> dict[str, Any]:
    fnd = record.findings()
    steps = [f.step for f in session.frames]
    last_step = steps[-1] if steps else None
    failures = [{"step": f.step, "rank": int(e.rank), "kind": e.kind, "error": e.error,
                 "message": str(e.message)[:300]} for f in session.frames for e in f.events.itertuples()]
    at_end = fnd[(fnd["step"] == last_step) & fnd["severity"].isin(["error", "warning"])] if len(fnd) else fnd
    how = [f"{r.detector}: " + (f"rank {int(r.rank)} " if pd.notna(r.rank) else "")
           + str(r.finding)[:140] for r in at_end.itertuples()]
    how = [f"{x['step']}: rank {x['rank']} {x['kind']} {x['error']}" for x in failures] + how
    return {
        "steps_run": steps,
        "complete": len(steps) == len(session.steps),
        "failures": failures,
        "findings_at_end": _records(at_end),
        "bug_observed": bool(len(at_end) or failures),
        # warnings alone (a shard or a per-rank value that differs by design) do not make a fix unclean
        "clean": not failures and not (at_end["severity"] == "error").any(),
        "how": how,
    }


def save_bundle(session, record, path: Path) -> str:
    """Save through workbench.postmortem.bundle when that module exists; return what happened."""
    try:
        from workbench.postmortem import bundle
    except ImportError:
        return "no workbench.postmortem.bundle"
    save = getattr(bundle, "save", None)
    if save is None:
        return "workbench.postmortem.bundle has no save()"
    last_exc = None
    for obj in (session, record):
        try:
            out = save(obj, str(path))
            return f"saved {out or path}"
        except Exception as exc:  # try the other argument form, then report
            last_exc = exc
    return f"bundle.save failed: {type(last_exc).__name__}: {last_exc}"


def ensure_usable(cluster, log) -> str:
    """After a run that hung or killed a rank, bring the ranks back before the next run.

    On NCCL a rank stuck behind a collective is not released by the group's timeout in
    any useful time (its thread sits in the driver), so it gets fresh engines at once.
    """
    if not cluster.alive:
        cluster.start()
        return "started"
    nccl = cluster.backend == "nccl"
    if hasattr(cluster, "needs_recovery"):
        if not cluster.needs_recovery:
            return ""
        info = cluster.recover(wait=2.0 if nccl else None)
        log(f"  recovered: {info}")
        return f"recovered: {info.get('action', info) if isinstance(info, dict) else info}"
    dead = cluster.dead_ranks()
    if dead or cluster._dead:
        log(f"  rank(s) {sorted(set(dead) | cluster._dead)} died: restarting engines")
        cluster.restart()
        return "restarted (dead rank)"
    if cluster._busy and not cluster.wait_idle(2.0 if nccl else cluster.timeout + 15):
        log(f"  rank(s) {sorted(cluster._busy)} still stuck: restarting engines")
        cluster.restart()
        return "restarted (stuck rank)"
    return ""


# Extra runs at other shapes, where the shape changes what the GPU does. The headline's
# mispaired broadcast hangs rank 1's stream when the bf16 bucket is small (NCCL picks the LL
# protocol) and returns silently with shifted tensors when it is larger (SIMPLE protocol);
# see scripts/nccl_headline_probe.py.
EXTRA_RUNS: dict[str, list[tuple[str, str | None, dict[str, Any]]]] = {
    "fsdp1-rotary-meta-init": [
        ("bug@3.4MB-bucket", None, {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "vocab_size": 1000}),
    ],
}

# Scenarios whose bug path hangs by design: a short step deadline keeps the suite inside its limit.
STEP_DEADLINE_S: dict[str, float] = {"weight-sync-order-desync": 20.0, "stale-conversion-cache": 20.0}


def run_one(cluster, name: str, fix: str | None, out: Path, log, fresh_group: bool = False,
            params: dict[str, Any] | None = None, label: str | None = None) -> dict[str, Any]:

    label = label or fix or "bug"
    t0 = time.perf_counter()
    recovery = ensure_usable(cluster, log)
    if fresh_group and not recovery:
        # A mispaired collective can return silently on NCCL and leave work queued on a
        # rank: every run gets a freshly formed group, so no run inherits another's state.
        cluster.dirty = True
    session = cluster.session(name, fix=fix, **(params or {}))
    session.deadline = STEP_DEADLINE_S.get(name)
    error = None
    try:
        session.run()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    wall = time.perf_counter() - t0
    record = session.record()
    verdict = judge(session, record)
    shown = rank_view(session)
    stem = f"{name}__{label}".replace("@", "_at_")
    result = {
        "scenario": name, "fix": fix, "run": label, "wall_s": wall, "recovery_before": recovery,
        "driver_error": error, "shown": shown, **verdict,
        "step_elapsed": [{"step": f.step, **{str(r): t for r, t in f.elapsed.items()}} for f in session.frames],
        "manifest": record.manifest,
        "outputs": _records(record.outputs),
        "events": _records(record.events),
        "notes": record.notes,
        "tensors_last_step": _records(session.last.tensors) if session.last is not None else [],
    }
    result["bundle"] = save_bundle(session, record, out / f"{stem}.bundle")
    (out / f"{stem}.json").write_text(json.dumps(_jsonable(result), indent=1, allow_nan=False))
    try:
        session.reset()
    except Exception as exc:
        log(f"  reset failed: {exc}")
    return result


def warm_figures(cluster, results: list[dict[str, Any]], log) -> dict[str, Any]:
    """Cold vs warm: the first clean run again on the same engines, and a group re-formation."""
    clean = [r for r in results if r.get("clean") and r.get("fix")]
    if not clean:
        return {}
    r = clean[0]
    try:
        ensure_usable(cluster, log)
        t0 = time.perf_counter()
        cluster.form_group()
        group_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cluster.session(r["scenario"], fix=r["fix"]).run()
        warm_s = time.perf_counter() - t0
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    fig = {"scenario": r["scenario"], "fix": r["fix"], "cold_s": r["wall_s"], "warm_s": warm_s,
           "reform_group_s": group_s}
    log(f"warm figures: {fig}")
    return fig


def table(results: list[dict[str, Any]]) -> str:
    head = ["scenario", "run", "rank view", "bug observed (how)", "fix clean", "time"]
    lines = []
    for r in results:
        ranks = " | ".join(f"r{k}: {v}" for k, v in sorted(r["shown"].items(), key=lambda kv: int(kv[0])))
        if r["fix"] is None:
            bug = ("yes: " + "; ".join(r["how"][:3])) if r["bug_observed"] else "NO"
            clean = "-"
        else:
            bug = ("-" if not r["how"] else "warnings: " + "; ".join(r["how"][:2])) if r["clean"] \
                else "still: " + "; ".join(r["how"][:2])
            clean = "yes" if r["clean"] else "no"
        lines.append([r["scenario"], r["run"], ranks, bug, clean, f"{r['wall_s']:.1f}s"])
    out = ["\t".join(head)]
    for row in lines:
        out.append("\t".join(row))
    # Also a readable block per run (tabs are for machines).
    out.append("")
    for row in lines:
        out.append(f"== {row[0]} / {row[1]}  [{row[5]}]  fix clean: {row[4]}")
        out.append(f"   ranks: {row[2]}")
        out.append(f"   bug:   {row[3]}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("SUITE_OUT", "gpu-out"))
    ap.add_argument("--ranks", type=int, default=None, help="default: number of GPUs (or 2 on CPU)")
    ap.add_argument("--backend", default=None, help="nccl (default with GPUs) or gloo")
    ap.add_argument("--timeout", type=float, default=30.0, help="collective timeout (s) of the group")
    ap.add_argument("--only", nargs="*", default=None, help="scenario ids (default: all in the catalogue)")
    ap.add_argument("--shared-group", action="store_true",
                    help="keep one process group across runs (default on NCCL: re-form it before each run)")
    args = ap.parse_args(argv)

    import torch

    import workbench as wb
    from workbench import scenarios

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend or ("nccl" if gpus >= 2 else "gloo")
    ranks = args.ranks or (gpus if backend == "nccl" else 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "suite.log", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    names = scenarios.names() if not args.only else args.only
    log(f"suite: {len(names)} scenario(s) {names}; backend={backend} ranks={ranks} gpus={gpus} "
        f"torch={torch.__version__} nccl={torch.cuda.nccl.version() if gpus else '-'}")
    t0 = time.perf_counter()
    cluster = wb.start(ranks=ranks, backend=backend, timeout=args.timeout)
    log(f"cluster up: engines {cluster.start_s:.1f}s, imports {cluster.imports_s:.1f}s, group {cluster.group_s:.2f}s, "
        f"devices {cluster.devices}")
    results: list[dict[str, Any]] = []
    fresh = backend == "nccl" and not args.shared_group
    meta = {"backend": backend, "ranks": ranks, "gpus": gpus, "torch": torch.__version__,
            "engine_start_s": cluster.start_s, "imports_s": cluster.imports_s, "group_s": cluster.group_s,
            "devices": cluster.devices}
    try:
        for name in names:
            try:
                sc = scenarios.get(name)
            except Exception as exc:
                log(f"{name}: cannot load: {type(exc).__name__}: {exc}")
                results.append({"scenario": name, "fix": None, "run": "load", "wall_s": 0.0, "shown": {},
                                "bug_observed": False, "clean": False, "how": [f"load failed: {exc}"]})
                continue
            plan = [(fix or "bug", fix, {}) for fix in [None, *sc.fixes]] + EXTRA_RUNS.get(name, [])
            for label, fix, params in plan:
                log(f"-- {name} / {label}")
                try:
                    r = run_one(cluster, name, fix, out, log, fresh_group=fresh, params=params, label=label)
                except Exception as exc:
                    log(traceback.format_exc())
                    r = {"scenario": name, "fix": fix, "run": label, "wall_s": 0.0, "shown": {},
                         "bug_observed": False, "clean": False, "how": [f"driver: {type(exc).__name__}: {exc}"]}
                results.append(r)
                log(f"   {r['wall_s']:.1f}s bug_observed={r['bug_observed']} clean={r['clean']} "
                    f"shown={r['shown']}")
        meta["warm"] = warm_figures(cluster, results, log)
    finally:
        cluster.stop()
    meta["total_s"] = time.perf_counter() - t0
    txt = table(results)
    (out / "suite.txt").write_text(txt + "\n")
    summary = [{k: r.get(k) for k in ("scenario", "run", "fix", "wall_s", "bug_observed", "clean", "how", "shown",
                                      "bundle", "recovery_before")} for r in results]
    (out / "suite.json").write_text(json.dumps(_jsonable({"meta": meta, "runs": summary}), indent=1))
    log(txt)
    ok = all(r["bug_observed"] if r["fix"] is None else True for r in results)
    verdict = "every bug path showed its bug" if ok else "SOME BUG PATH SHOWED NOTHING"
    log(f"suite done in {meta['total_s']:.1f}s: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
