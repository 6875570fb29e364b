"""A point finished on the writer thread (``rank/point_deferred.py``) writes the rows the job's thread would have.

A GPU job's points are launched on the job's thread and made into rows on the capture's writer once the probe's
kernel is done. Here the same job runs twice through Triton's interpreter (the fused kernel on CPU tensors, in a
subprocess: the flag is read when the kernel is defined): once with the writer thread, where the deferred path is
taken, once inline. Every row of every point must be the same, byte for byte: the statistics, ``written`` against
``to_empty``'s poison, the rope's ``ref_diff``, agreement, the outputs' annotations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _job(out: str) -> None:
    """A tiny Llama built on meta, materialised with ``to_empty`` (poisoned), its rope left as ``to_empty`` left it
    and one projection never written, its head expected to be zero (it is not); three AdamW steps, a point after each
    with the logits and the loss."""
    import torch

    from workbench.rank import point_deferred, probe_fused

    probe_fused.FUSED_DEVICES = ("cuda", "cpu")
    probe_fused.WORDS_PER_ITER, probe_fused.ITERS = 256, 2
    probe_fused.SPLIT_BYTES = 0  # the model in two launches, as a large one is on a GPU
    taken = []
    launch = point_deferred.launch
    point_deferred.launch = lambda *a: taken.append(launch(*a)) or taken[-1]

    from transformers import LlamaConfig, LlamaForCausalLM

    import workbench.job as wj

    cap = wj.capture(out, ledger=False)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=64, attn_implementation="eager")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "model.layers.1.mlp.up_proj.weight":
                p.copy_(torch.randn_like(p) * 0.02 if p.dim() > 1 else torch.ones_like(p))
    cap.expect("model.lm_head.weight", torch.zeros(cfg.vocab_size, cfg.hidden_size))  # 4 KB: a host copy
    cap.point("materialised", model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
        out_ = model(input_ids=ids, labels=ids)
        out_.loss.backward()
        opt.step()
        opt.zero_grad()
        cap.point(f"step{step}", model=model, logits=out_.logits, loss=out_.loss)
    cap.close()
    print("deferred", sum(d is not None for d in taken), "of", len(taken))


def _points(folder: Path) -> list[dict]:
    files = list(folder.rglob("points.jsonl"))
    assert len(files) == 1, files
    out = []
    for line in files[0].read_text().splitlines():
        rec = json.loads(line)
        for k in ("t", "elapsed", "probe_s"):
            rec.pop(k, None)
        out.append(rec)
    return out


def test_a_point_finished_on_the_writer_writes_the_rows_the_jobs_thread_would(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    from workbench.rank import point_deferred

    assert point_deferred.launch({}, None, 0) is None  # a point of bare outputs: made on the job's thread
    procs = {}
    for how in ("thread", "inline"):  # both at once
        code = (f"import runpy; runpy.run_path({str(Path(__file__))!r}, run_name='__job__')"
                f"['_job']({str(tmp_path / how)!r})")
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), WORKBENCH_CAPTURE_WRITER=how)
        for k in ("WORKBENCH_CAPTURE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        procs[how] = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
    runs = {}
    for how, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            proc.kill()
        assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
        runs[how] = (stdout, _points(tmp_path / how))
    assert "deferred 4 of 4" in runs["thread"][0], runs["thread"][0]
    assert "deferred 0 of 0" in runs["inline"][0], runs["inline"][0]
    deferred, inline = runs["thread"][1], runs["inline"][1]
    assert [p["point"] for p in deferred] == ["materialised", "step0", "step1", "step2"]
    rows = {r["name"]: r for r in deferred[0]["tensors"]}
    assert rows["model.model.layers.1.mlp.up_proj.weight"]["written"] == "never written"
    assert rows["model.model.layers.1.mlp.down_proj.weight"]["written"] == "written"
    assert rows["model.model.rotary_emb.inv_freq"]["ref_diff"] not in (None, 0.0)  # read from its row's bytes
    assert rows["model.lm_head.weight"]["ref_diff"] not in (None, 0.0)  # from a host copy
    assert {r["name"] for r in deferred[-1]["outputs"]} == {"logits", "loss"}
    for a, b in zip(deferred, inline):
        assert json.dumps(a) == json.dumps(b), a["point"]


def test_until_a_deferred_points_rows_are_made_the_latest_is_the_point_before(tmp_path, monkeypatch):
    """A point whose kernel waits (queued behind a collective that never completes) has no rows yet: what a post
    mortem or the debug server reads as the latest is then the point before it, with its rows, not a record
    without any. Here the deferred point is a stand-in whose rows wait for the test."""
    import threading

    import torch

    import workbench.job as wj
    from workbench.rank import point_deferred

    monkeypatch.setenv("WORKBENCH_CAPTURE_WRITER", "thread")
    for k in ("WORKBENCH_CAPTURE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cap = wj.capture(tmp_path / "cap", ledger=False, poison=False)
    try:
        model = torch.nn.Linear(2, 2)
        cap.point("before", model=model)  # on CPU: made on the writer, not deferred
        assert cap.flush() and cap.latest["point"] == "before" and cap.latest["tensors"]
        release = threading.Event()

        class Waiting:
            count = 1

            def rows(self):
                assert release.wait(60)
                return [{"name": "model.weight"}], []

        monkeypatch.setattr(point_deferred, "launch", lambda objects, ctx, rank: Waiting())
        cap.point("stuck", model=model)
        assert cap.latest["point"] == "before" and cap.latest["tensors"]  # not the stuck one's empty record
        release.set()
        assert cap.flush()
        assert cap.latest["point"] == "stuck" and cap.latest["tensors"] == [{"name": "model.weight"}]
    finally:
        release.set()
        cap.close()


def test_a_deferred_points_rows_are_made_once_the_next_point_is_handed_over(tmp_path, monkeypatch):
    """On a GPU job that reads its loss each step, a point's kernel is done just as the job's thread starts launching
    the next step, with the device idle: the writer's rows and JSON then took the GIL from those launches. A deferred
    point's rows are made once the next point is handed over (the device a step behind), a drain, or ``LAG_S``
    after; collection stays the job's meanwhile (no rows live yet) and is held while the writer makes them."""
    import gc
    import threading
    import time

    import torch

    import workbench.job as wj
    from workbench.job import writer
    from workbench.rank import point_deferred

    monkeypatch.setenv("WORKBENCH_CAPTURE_WRITER", "thread")
    for k in ("WORKBENCH_CAPTURE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(writer, "LAG_S", 60.0)
    made: list[tuple[str, bool]] = []
    one = threading.Event()

    class Ready:
        count = 1

        def __init__(self, name: str) -> None:
            self.name = name

        def rows(self):
            made.append((self.name, gc.isenabled()))
            one.set()
            return [{"name": "model.weight"}], []

    names = iter(["s0", "s1", "s2"])
    monkeypatch.setattr(point_deferred, "launch", lambda objects, ctx, rank: Ready(next(names)))
    cap = wj.capture(tmp_path / "cap", ledger=False, poison=False)
    model = torch.nn.Linear(2, 2)
    written = tmp_path / "cap" / "rank0" / "points.jsonl"
    try:
        assert gc.isenabled()
        cap.point("s0", model=model)
        assert gc.isenabled()  # handed over with no rows yet: collection is the job's again
        assert not one.wait(0.3) and made == []  # waits for the next point
        cap.point("s1", model=model)
        assert one.wait(30) and made == [("s0", False)]  # made when s1 came, collection held while made
        one.clear()
        assert not one.wait(0.3) and len(made) == 1  # s1 in turn waits for s2
        assert cap.flush() and [m[0] for m in made] == ["s0", "s1"]  # a drain does not wait
        assert [json.loads(x)["point"] for x in written.read_text().splitlines()] == ["s0", "s1"]
        monkeypatch.setattr(writer, "LAG_S", 0.2)
        one.clear()
        cap.point("s2", model=model)  # the last point of a job that takes no more: made after LAG_S by itself
        assert one.wait(30) and [m[0] for m in made] == ["s0", "s1", "s2"]
        deadline = time.monotonic() + 30
        while "s2" not in written.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(written.read_text().splitlines()[-1])["point"] == "s2"
        deadline = time.monotonic() + 30  # the writer lets collection go just after it wrote the line
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.isenabled()  # the writer's hold ended with the line
    finally:
        cap.close()
