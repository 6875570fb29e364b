"""``close()`` leaves torch as it found it (``guest.py``: "its modes, wrappers, hooks ... go"): every function,
method and global hook the capture or its automatic points patched is the original again, no mode is left on
torch's stacks, the process's own hooks (excepthook, import finders) are back, and no thread of the capture
is alive. A job that closes its capture and trains on (or a notebook that opens a second one) runs plain torch.

A single-rank gloo group in this process, so the ledger and the post-mortem watcher install as in a job.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import workbench.job as wj
from workbench.job import hooks, shard

pytestmark = pytest.mark.check

# Where a capture patches: modules and classes whose attributes are compared by identity before and after.
SPOTS = ["torch", "torch.Tensor", "torch.nn.Module", "torch.autograd", "torch.distributed",
         "torch.distributed.distributed_c10d", "torch.optim.Optimizer", "torch.nn.parallel.DistributedDataParallel",
         "torch.distributed.fsdp", "torch.distributed.fsdp.FullyShardedDataParallel",
         "torch.distributed.checkpoint.state_dict", "torch.nn.modules.module"]
GLOBAL_HOOKS = ["torch.optim.optimizer._global_optimizer_post_hooks",
                "torch.optim.optimizer._global_optimizer_pre_hooks",
                "torch.nn.modules.module._global_forward_hooks",
                "torch.nn.modules.module._global_forward_pre_hooks",
                "torch.nn.modules.module._global_backward_hooks"]


def _resolve(path: str):
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _state() -> dict[str, object]:
    """Taken after ``import torch._dynamo`` (the ledger imports it at install; dynamo's import itself rewraps
    ``torch.manual_seed``, a change of torch's, not the capture's).

    Every attribute of the spots by identity, the global hook tables by their keys, the modes, the process's
    hooks and the threads."""
    import torch._dynamo

    out: dict[str, object] = {}
    for spot in SPOTS:
        obj = _resolve(spot)
        names = vars(obj) if isinstance(obj, type) else {n: getattr(obj, n, None) for n in dir(obj)}
        for name, value in dict(names).items():
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                out[f"{spot}.{name}"] = id(value)
    for table in GLOBAL_HOOKS:
        out[table] = sorted(_resolve(table).keys())
    out["torch function modes"] = torch._C._len_torch_function_stack()
    out["torch dispatch modes"] = torch._C._len_torch_dispatch_stack()
    out["sys.excepthook"] = id(sys.excepthook)
    out["sys.meta_path"] = [id(f) for f in sys.meta_path]
    out["threads"] = sorted(t.name for t in threading.enumerate())
    return out


def _diff(before: dict[str, object], after: dict[str, object]) -> list[str]:
    return [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]


@pytest.fixture
def group(tmp_path, monkeypatch):
    for k in ("WORKBENCH_CAPTURE", "WORKBENCH_CAPTURE_PID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(shard, "_SAID", set())
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    dist.all_reduce(torch.ones(1))


def test_close_gives_back_every_patch_mode_hook_and_thread(group, tmp_path):
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp

    before = _state()
    cap = wj.capture(tmp_path / "cap", poison="all", ledger="full", attach="post-mortem")
    hk = hooks.Hooks(cap, every=1).install()
    assert _diff(before, _state()), "nothing was patched: the test would prove nothing"
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        _train(model, opt)
    cap.point("after", model=model)
    taken = list(cap.points)
    assert {"to_empty", "step1", "step2", "after"} <= set(taken), taken  # the hooks were on: they took points
    cap.close()
    left = _diff(before, _state())
    assert left == [], f"close left these as the capture made them: {left}"
    _train(model, opt)  # the job trains on, plain: no automatic point, no hook error
    assert cap.points == taken and hk.errors == []


def test_a_fault_gives_them_back_too(group, tmp_path, capfd):
    import torch.distributed.fsdp  # noqa: F401

    before = _state()
    cap = wj.capture(tmp_path / "cap", attach="on-error")
    hooks.Hooks(cap, every=1).install()
    cap._fault("at a test's planted fault", RuntimeError("planted"))
    assert "capture stopped at a test's planted fault" in capfd.readouterr().err
    left = _diff(before, _state())
    assert left == [], f"a fault left these as the capture made them: {left}"
    assert os.path.exists(tmp_path / "cap")


def test_the_world_group_is_held_from_the_first_point_to_the_close(group, tmp_path):
    """The capture holds the world group from its first point until it closes (``Points._where``), so the group's
    last reference never drops inside the job's own teardown, where torch's ``~ProcessGroupGloo`` deadlocked a DDP
    job at exit (a worker dropping a backward's work waits for the GIL the joining thread holds; 7 of 24
    zero-code accelerate jobs on a loaded box, 0 of 48 with the hold). At close the hold goes: the group's
    lifetime is torch's again."""
    cap = wj.capture(tmp_path / "cap")
    assert cap._world_pg is None  # nothing held before a point
    cap.point("first", model=nn.Linear(2, 2))
    assert cap._world_pg is dist.group.WORLD
    cap.close()
    assert cap._world_pg is None


@pytest.mark.parametrize("failing", [False, True])
def test_a_ranks_files_undo_what_they_opened_and_installed_on_the_stack_they_were_given(group, tmp_path, failing):
    """``shard_files.RankFiles``: the folder, the points file and the calls ledger (its wrappers around
    ``torch.distributed``, Flight Recorder's complement) each put their undo on the caller's stack as they open, so
    the stack's close leaves torch as it was; a step that fails (here the ledger's file, a directory in its place)
    leaves nothing of the steps before it. The run before in that folder is kept aside under ``previous/``."""
    import contextlib

    from workbench.rank import shard_files, shard_format

    root = tmp_path / "cap"
    old = shard_format.rank_dir(root, 0)
    old.mkdir(parents=True)
    (old / shard_format.MANIFEST).write_text("{}")  # a shard of the run before
    if failing:
        (old / shard_format.MANIFEST).unlink()  # nothing to keep aside; the ledger's file cannot be opened
        (old / "rank0.jsonl").mkdir()
    before = _state()
    stack = contextlib.ExitStack()
    try:
        files = shard_files.RankFiles(root, 0, stack, ledger="calls", session="s", attempt=0, fault=None,
                                      before_destroy=lambda: None)
    except OSError:
        assert failing
        files = None
    if files is not None:
        assert not failing
        assert _diff(before, _state()), "the calls ledger installed nothing: the test would prove nothing"
        assert files.fr is not None and files.calls.flight_recorder is not None
        assert (root / "previous" / "rank0" / shard_format.MANIFEST).is_file()  # the run before, kept aside
        assert not files.points.closed
    stack.close()
    assert _diff(before, _state()) == []
    if files is not None:
        assert files.points.closed


PINNED = r'''
import os, sys, tempfile
import torch, torch.distributed as dist
import workbench.job as wj

d = tempfile.mkdtemp()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
pg = dist.group.WORLD
threads = len(os.listdir("/proc/self/task"))
cap = wj.capture(os.path.join(d, "cap"), ledger=sys.argv[1])
dist.all_reduce(torch.ones(2))  # through the recorder's mode: torch imports torch._dynamo and ~900 modules here
cap.point("step0", model=torch.nn.Linear(2, 2))
cap.close()
dist.destroy_process_group()
refs = sys.getrefcount(pg) - 1
del pg  # the last reference, where nothing else holds the group: its threads are joined here
print("refs", refs, "threads", threads, len(os.listdir("/proc/self/task")))
'''


@pytest.mark.parametrize("ledger", ["calls", "full"])
def test_the_job_s_destroy_frees_its_group_after_a_capture_opened_after_init(tmp_path, ledger):
    """Opened after ``init_process_group``, the capture's ledger imports ``torch._dynamo`` (``ledger.prepare``),
    and with it ``torch.distributed.nn.functional``, whose functions take ``group=group.WORLD`` as a default
    evaluated at import: the job's world group, held for good. The job's ``destroy_process_group`` then freed
    nothing: gloo's worker threads lived into interpreter exit, where one dropping a finished all-reduce's work
    (its tensor's Python object died with ``main()``) takes the GIL during finalisation and aborts the process
    ("terminate called without an active exception"; 2 of ~116 full-disk fault jobs under load, core dump). The
    group's last references must be the job's: after its destroy, only this script's ``pg``; its threads gone."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", PINNED, ledger], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    refs, before, after = int(words[1]), int(words[3]), int(words[4])
    assert refs == 1, out.stdout  # the script's own name for it, nothing else
    assert after < before, out.stdout  # the group's worker threads joined at its destroy


def test_the_close_names_who_holds_the_world_group_after_the_job_destroyed_it():
    """A group the job destroyed but something still holds lives into interpreter exit, where gloo may abort the
    rank after its last line (DeepSpeed's parameters each hold one: ``ds_process_group``). The close records the
    holders by what they call it; a group still in torch's registry, or held by the capture alone, is no leak."""
    from workbench.job import teardown

    class Holder:
        pass

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    cap = Holder()
    cap.pg = dist.group.WORLD  # the capture's own reference (``Points._world_pg``)
    try:
        held = [Holder() for _ in range(3)]
        for h in held:  # as DeepSpeed's parameters: the group among other attributes
            h.ds_process_group, h.ds_shape = cap.pg, [4, 4]
        assert teardown.outlived(cap, "pg") is None  # not destroyed: torch's registry holds it
    finally:
        dist.destroy_process_group()
    assert teardown.outlived(cap, "pg") == {"refs": 3, "holders": "3 objects' `ds_process_group`"}
    held[0].other = cap.pg
    assert teardown.outlived(cap, "pg")["holders"] == "3 objects' `ds_process_group`, 1 object's `other`"
    hidden = {"group": cap.pg}  # a dict of untracked objects only: the collector does not see it
    assert teardown.outlived(cap, "pg")["holders"] == "3 objects' `ds_process_group`, 1 object's `other`, 1 more"
    del held, h
    assert teardown.outlived(cap, "pg") == {"refs": 1, "holders": "none that the garbage collector can name"}
    del hidden
    assert teardown.outlived(cap, "pg") is None  # only the capture's: nothing to say


@pytest.mark.parametrize("ledger", ["calls", "full"])
def test_every_function_put_over_torch_is_passed_over_by_warnings(group, tmp_path, ledger):
    """A wrapper is one more frame between the job's line and torch's function: a warning torch gives with
    ``stacklevel=2`` named the wrapper's line (``workbench/job/hooks.py:264``) instead of the job's. Every function
    the capture and its automatic points put in torch's place is ``patch.unseen``, which ``warnings`` passes over."""
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp  # noqa: F401

    from workbench.rank import patch

    before = _state()
    cap = wj.capture(tmp_path / "cap", poison="all", ledger=ledger, attach="post-mortem")
    hooks.Hooks(cap, every=1).install()
    try:
        put = []
        for key in _diff(before, _state()):
            spot, _, name = key.rpartition(".")
            if spot in SPOTS:
                obj = _resolve(spot)
                value = vars(obj).get(name) if isinstance(obj, type) else getattr(obj, name, None)
                fn = getattr(value, "__func__", value)
                if hasattr(fn, "__code__"):
                    put.append((key, fn.__code__.co_filename))
        assert len(put) >= 10, put  # to_empty, backward, DDP's and FSDP's construction, the ledger's, ...
        # a context manager's wrapper (``_coalescing_manager``) is contextlib's: its frames are contextlib's as well
        seen = [key for key, filename in put if not filename.endswith(patch.UNSEEN) and filename != contextlib.__file__]
        assert seen == [], f"warnings would name these wrappers' lines, not the job's: {seen}"
    finally:
        cap.close()
