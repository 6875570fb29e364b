"""Capture with no line of the user's code: automatic points after the calls incidents live in.

    workbench job runs/x -- torchrun --nproc-per-node 4 train.py      # or WORKBENCH_CAPTURE=runs/x
    workbench report runs/x

``workbench job`` puts ``workbench/job/site`` on the job's ``PYTHONPATH`` and ``WORKBENCH_CAPTURE=<dir>``
in its environment, then becomes the launcher (``exec``: its exit status, output and signals are the
launcher's own). That directory holds a ``sitecustomize`` (which chains any other one on the path): in
a process of the job it reads the variable and, only where it names a directory, imports this module
(absent or ``0``, nothing of the workbench is imported). ``arm()`` then waits for the rank's ``import
torch`` (a finder on ``sys.meta_path``, at no cost to anything else the process imports) and starts
the rank's capture right after it, before any line of the script ran past that import: poison of what
``to_empty`` hands out, the collective ledger, post mortem on error and on a proven deadlock. The
launcher's own process (torchrun's agent, ``accelerate launch``), processes without a rank, and the
children a rank starts (data-loader or compile workers) capture nothing.

The automatic points, each after the call returned and named after it, probe the module it acted on
(``POINTS``): FSDP's and DDP's wrappers are probed through the module they wrap (the names a manual
``cap.point("x", model=model)`` gives). Each is a wrapper of the torch function or method (made at
import, ``functools.wraps``: the same signature, the same return value, an exception passes through
untouched and makes no point) or one of torch's own hooks (a forward hook on each wrapped root, removed
after its first call; the global optimizer step post hook; ``__init_subclass__`` for classes that define
``load_weights``). A hooked call made inside another one (``to_empty`` inside FSDP1's ``param_init_fn``,
``load_state_dict`` inside ``set_model_state_dict``, a nested FSDP1 wrap) makes no point of its own. A
point that fails is a line in the shard's ``hook_errors``, never an exception in the job. The user's
own ``wj.capture(...)`` returns the same capture, so their ``cap.point`` lines still work beside these.

Where a rank takes a point the others do not (rank 0 alone loading a state dict), the reader pairs the ranks'
points by name, not position, and says which rank took which point alone (``postmortem/shards.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import json
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from workbench.job import config, losses, materialise, owners, process
from workbench.rank import patch

# the variables, the words and the points are config.py's (the one place that reads the environment)
ENV, ENV_EVERY, ENV_POINTS, ENV_ATTACH = config.ENV, config.ENV_EVERY, config.ENV_POINTS, config.ENV_ATTACH
ENV_DEADLINE, ENV_HANG_AFTER, ENV_POISON, ENV_PID = (config.ENV_DEADLINE, config.ENV_HANG_AFTER, config.ENV_POISON,
                                                      config.ENV_PID)
OFF = config.WORDS  # words, not directories
POINTS = config.POINTS
LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
             "accelerate.commands.accelerate_cli", "deepspeed.launcher.runner")
_MARK = "__workbench_hook__"
_HERE = os.path.abspath(__file__)


# -- in which process, with what: read from the environment --------------------------------------------
def directory(env: dict[str, str] | None = None) -> str | None:
    """The capture directory ``WORKBENCH_CAPTURE`` names, or None (absent, ``0``, or a word like ``1``)."""
    return config.from_env(env).directory


def is_rank(env: dict[str, str] | None = None, argv: list[str] | None = None, pid: int | None = None) -> bool:
    """Whether this process is a rank of the job: the launcher set its rank (torchrun's ``RANK``/``WORLD_SIZE``,
    srun's ``SLURM_PROCID``/``SLURM_NTASKS``), it is not a launcher itself, and no process above it captures."""
    env = os.environ if env is None else env
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    pid = os.getpid() if pid is None else pid
    if not _ranked(env):
        return False
    capturing = config.from_env(env).pid
    if capturing is not None and capturing != pid:
        return False  # a worker a rank started: its parent captures
    return not _launcher(argv)


def _ranked(env: Mapping[str, str]) -> bool:
    """Whether a launcher gave this process its rank: torchrun's ``RANK``/``WORLD_SIZE``, srun's
    ``SLURM_PROCID``/``SLURM_NTASKS``."""
    return ("RANK" in env and "WORLD_SIZE" in env) or ("SLURM_PROCID" in env and "SLURM_NTASKS" in env)


def _launcher(argv: list[str]) -> bool:
    """Whether ``argv`` runs a launcher (torchrun, ``accelerate launch``, deepspeed's runner), not a job's script."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1] in LAUNCHERS
        if not arg.startswith("-") and i > 0:  # the script (or the program's first argument)
            break
    head = os.path.basename(argv[1] if len(argv) > 1 and os.path.basename(argv[0]).startswith("python")
                            else argv[0]) if argv else ""
    return head in ("torchrun", "accelerate", "deepspeed")


def unranked(env: Mapping[str, str] | None = None, argv: list[str] | None = None) -> bool:
    """Whether this process runs under ``workbench job`` with no rank from a launcher, is no launcher itself, and has
    no capturing process above it: a rank may still come to it through its own ``init_process_group(rank=...)``
    (``torch.multiprocessing.spawn``'s ranks, Lightning's own launcher), or never (one process alone, a helper)."""
    env = os.environ if env is None else env
    if _ranked(env):
        return False
    got = config.from_env(env)
    if got.launcher_pid is None or got.pid is not None:  # not under workbench job, or a capturing rank's worker
        return False
    return not _launcher(list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv))


def rankless_job(env: dict[str, str] | None = None, argv: list[str] | None = None, pid: int | None = None,
                 ppid: int | None = None, parent_argv: list[str] | None = None) -> bool:
    """Whether this process is the job itself, run with no rank: the command ``workbench job`` ran (``python
    train.py``), or the one process ``accelerate launch`` started for it (its ``--cpu`` without ``--multi_gpu``).
    Such a process is what the job's ranks would come from: if no process of the job captured, it says so at its
    exit. A shell's children are left alone (a script's helper ``python -c`` before torchrun)."""
    env = os.environ if env is None else env
    if not unranked(env, argv):
        return False
    got = config.from_env(env)
    pid = os.getpid() if pid is None else pid
    if pid == got.launcher_pid:
        return True
    ppid = os.getppid() if ppid is None else ppid
    if ppid != got.launcher_pid:
        return False
    if parent_argv is None:
        try:
            with open(f"/proc/{ppid}/cmdline", "rb") as f:
                parent_argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # no /proc: say nothing
            return False
    return any(os.path.basename(a) == "accelerate" or a == "accelerate.commands.launch" for a in parent_argv[:3])


RANKLESS = ("workbench: this job captured nothing: no launcher gave a process a rank (torchrun's RANK and "
            "WORLD_SIZE, srun's SLURM_PROCID) and none joined a process group; to capture one process, run it as "
            "`torchrun --nproc-per-node 1 train.py`")


def start_on_join(job: bool) -> None:
    """Start this process's capture once it joins a process group: its rank is known from then on (the group's).
    ``job``: this is the job's own process (``rankless_job``): at its exit, if no process of the job captured (no
    rank's folder in the capture directory), one line says so. The patch gives ``init_process_group`` back at the
    join; the points before it (a model built before the join) are not taken."""
    from torch import distributed as dist

    if job:
        import atexit

        atexit.register(_nothing_captured, directory())
    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    real = c10d.init_process_group
    undo: list[Callable[[], None]] = []

    def joined() -> None:
        while undo:
            undo.pop()()
        os.environ[ENV_PID] = str(os.getpid())  # this process's own children are its workers from now on
        taken = _rank_taken(dist.get_rank())
        if taken:
            _say(taken)
        else:
            start()

    @functools.wraps(real)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        _guarded(joined)  # the job's call returns as it would have, whatever this did
        return out

    undo += rebind("init_process_group", real, init_process_group)  # torch's own, and by-name imports (device_mesh)


def rebind(name: str, original: Callable, new: Callable) -> list[Callable[[], None]]:
    """Put ``new`` under ``name`` in every module that binds ``original`` there: the public name, its home, and a
    module that imported it by name before the capture started (a script's ``from torch.distributed.fsdp import
    fully_shard``, read before a capture that starts at the process group's join). A module's own dict is read, never
    its ``__getattr__`` (a lazy module's imports). Returns the undos."""
    return [patch.replace(module, name, new, original) for module in list(sys.modules.values())
            if module is not None and getattr(module, "__dict__", {}).get(name) is original]


def _rank_taken(rank: int) -> str | None:
    """One line where another live process of this job captures as ``rank`` already: a second group joined under
    the job (an inference engine's own group of one, started by the job) must not take over a rank's folder. Live:
    its shard still running and its process not gone (``shard_format.gone``: killed, crashed, a zombie)."""
    from workbench.rank import shard_format

    got = config.from_env()
    try:
        with open(shard_format.rank_dir(got.directory or "", rank) / shard_format.MANIFEST) as f:
            held = json.load(f)
    except (OSError, ValueError):
        return None
    if (not isinstance(held, dict) or held.get("job") != got.job or not isinstance(held.get("pid"), int)
            or held["pid"] == os.getpid() or held.get("status") != "running" or shard_format.gone(held)):
        return None
    return (f"workbench: this process joined a group as rank {rank}, whose capture process {held.get('pid')} of this "
            "job holds; it captures nothing")


def _nothing_captured(where: str | None) -> None:
    if process.STATE.hooks is not None or where is None:
        return
    with contextlib.suppress(OSError):
        if any(name.startswith("rank") for name in os.listdir(where)):
            return  # the job's ranks captured (its children): nothing to say
    _say(RANKLESS)


def options(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The wrapper's options, from the environment ``workbench job`` set (a bad value: said once, its default used).
    ``workbench job`` always sets the attach (post-mortem at a terminal, on-deadlock where nobody watches); a job that
    sets ``WORKBENCH_CAPTURE`` itself is read as unwatched: a raise fails at once, nobody waits for a notebook."""
    from workbench.job import shard

    return shard.say_problems(config.from_env(env)).options()


# -- waiting for torch: a finder that runs callbacks once a module has been executed --------------------
class _Then(importlib.abc.MetaPathFinder):
    """Runs ``callbacks[name]`` right after module ``name`` is imported (once), then gets out of the way: the
    module's spec and loader are given back as they were."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Callable[[Any], None]]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.waiting:
            return None
        callbacks = self.waiting.pop(name)
        if not self.waiting:
            with contextlib.suppress(ValueError):  # taken off already
                sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, callbacks)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, callbacks: list[Callable[[Any], None]]):
        self.inner, self.callbacks = inner, callbacks

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        spec = module.__spec__
        spec.loader = self.inner  # the module keeps its own loader
        module.__loader__ = self.inner
        self.inner.exec_module(module)
        for callback in self.callbacks:
            _guarded(callback, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_THEN = _Then()


def after_import(name: str, callback: Callable[[Any], None]) -> None:
    """``callback(module)`` once ``name`` is imported: now where it is already."""
    if name in sys.modules:
        _guarded(callback, sys.modules[name])
        return
    _THEN.waiting.setdefault(name, []).append(callback)
    if _THEN not in sys.meta_path:
        sys.meta_path.insert(0, _THEN)


def arm() -> bool:
    """The site hook's entry: in a rank of a job whose ``WORKBENCH_CAPTURE`` names a directory, start the capture
    as soon as torch is imported. Returns whether it armed."""
    if directory() is None:
        return False
    if not is_rank():
        if unranked():
            job = rankless_job()
            after_import("torch", lambda _torch: start_on_join(job))
        return False
    os.environ[ENV_PID] = str(os.getpid())
    after_import("torch", lambda _torch: start())
    return True


def start() -> Hooks | None:
    """This rank's capture (into ``WORKBENCH_CAPTURE``) with the automatic points on; one line on stderr and
    the job runs on without it if it cannot start."""
    if process.STATE.hooks is not None:
        return process.STATE.hooks
    try:
        from workbench.job import shard

        got = shard.say_problems(config.from_env())
        cap = shard.capture(got.directory, poison=got.poison.arg, ledger="calls", attach=got.attach,
                            attach_deadline=got.attach_deadline, hang_after=got.hang_after)
        return Hooks(cap, every=got.every, points=list(got.points)).install()
    except Exception as exc:  # the boundary of the site hook's start: one line, the job runs without capture
        _say(f"workbench: capture off in this process: {type(exc).__name__}: {exc}")
        return None


# -- the hooks --------------------------------------------------------------------------------------------
class Hooks:
    """The automatic points of one capture: ``install()`` wraps the calls, ``uninstall()`` gives them back."""

    def __init__(self, cap: Any, every: int | None = None, points: list[str] | tuple[str, ...] | None = None):
        config.check_points(points or ())
        if every is not None and every < 0:
            raise ValueError(f"every must be 0 (only the first step) or a positive number of steps; got {every}")
        self.cap = cap
        self.every: int | None = None if every is None else int(every)  # None: auto, as the rank's device says
        self._auto: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per optimizer: what auto came to
        # what the step points followed, kept past the optimizers (held weakly above: a job frees its optimizer
        # before the capture closes and records it): the most steps any ran, the interval auto came to
        self._ran = self._auto_every = 0
        self.points = set(points or POINTS)
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []
        self._roots: list[weakref.ref] = []  # modules points probed: what an optimizer step is probed as
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.errors: list[str] = []
        self.materialised: Any = None  # every to_empty's clobbered tensors (materialise.py)
        self.losses: Any = None  # the first non-finite loss (losses.py)

    # installing ---------------------------------------------------------------------------------------
    def install(self) -> Hooks:
        from torch import nn

        from workbench.rank import ledger

        if self.cap is not None and getattr(self.cap, "enabled", False):
            self.cap.hooks = self
            self.cap.on_close(self.uninstall)  # close and a fault give torch back as they found it
        # these wrappers (and the detectors' around to_empty and backward) sit between the user's line and torch
        self._undo.append(ledger.add_plumbing([_HERE, *map(os.path.abspath, (materialise.__file__, losses.__file__))]))
        if "to_empty" in self.points:
            self.materialised = materialise.Materialisations(self._error)  # inside the point's wrapper: seen first
            self._undo.append(self.materialised.install())
            self._method(nn.Module, "to_empty", self._after_to_empty)
        if "load_state_dict" in self.points:
            self._method(nn.Module, "load_state_dict", lambda a, k, r: self.point("load_state_dict", a[0]))
        if "step" in self.points:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            handle = register_optimizer_step_post_hook(self._after_step)
            self._undo.append(handle.remove)
            self.losses = losses.Losses(self._error, take=self._loss_point)
            self._undo.append(self.losses.install())
        if "load_weights" in self.points:
            self._subclasses(nn.Module)
        if "forward" in self.points:
            from torch.nn.parallel import DistributedDataParallel

            self._method(DistributedDataParallel, "__init__", lambda a, k, r: self._first_forward(a[0]))
        process.STATE.hooks = self
        if {"fully_shard", "FullyShardedDataParallel", "forward"} & self.points:
            after_import("torch.distributed.fsdp", self._when_installed(lambda _m: self._fsdp()))
        if "set_model_state_dict" in self.points:
            after_import("torch.distributed.checkpoint.state_dict", self._when_installed(self._dcp))
        return self

    def _when_installed(self, callback: Callable[[Any], None]) -> Callable[[Any], None]:
        """A later import's patch, made only while these hooks are still installed."""
        def run(module: Any) -> None:
            if process.STATE.hooks is self:
                callback(module)
        return run

    def uninstall(self) -> None:
        while self._undo:
            with contextlib.suppress(Exception):  # cleanup: every other patch still comes off
                self._undo.pop()()
        process.STATE.release("hooks", self)

    def _wrap(self, name: str, original: Callable, after: Callable[[tuple, dict, Any], None]) -> Callable:
        """``original`` with ``after(args, kwargs, result)`` once it returned, outside any other hooked call."""
        local = self._local

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "depth", 0)
            local.depth = depth + 1
            try:
                result = original(*args, **kwargs)
            finally:
                local.depth = depth
            if depth == 0:
                _guarded(after, args, kwargs, result, errors=self._error)
            return result

        setattr(call, _MARK, name)
        return patch.unseen(call)

    def _method(self, cls: type, name: str, after: Callable[[tuple, dict, Any], None]) -> None:
        original = patch.original(cls, name)
        if not getattr(original, _MARK, None):
            self._undo.append(patch.replace(cls, name, self._wrap(name, original, after), original))

    def _function(self, name: str, original: Callable, after: Callable[[tuple, dict, Any], None]) -> None:
        """Replace ``original`` under ``name`` wherever a module binds it (``rebind``)."""
        self._undo += rebind(name, original, self._wrap(name, original, after))

    def _subclasses(self, base: type) -> None:
        self._undo.append(_wrap_subclasses(self, base))

    def _receiver(self, cls: type) -> None:
        original = cls.__dict__.get("load_weights")
        if callable(original) and not getattr(original, _MARK, None):
            cls.load_weights = self._wrap("load_weights", original, lambda a, k, r: self.point("load_weights", a[0]))

    def _fsdp(self) -> None:
        import torch.distributed.fsdp as fsdp

        shard = getattr(fsdp, "fully_shard", None)
        if shard is not None and not getattr(shard, _MARK, None) and {"fully_shard", "forward"} & self.points:
            self._function("fully_shard", shard, self._after_fully_shard)
        if {"FullyShardedDataParallel", "forward"} & self.points:
            self._method(fsdp.FullyShardedDataParallel, "__init__", self._after_fsdp1)

    def _dcp(self, module: Any) -> None:
        original = module.set_model_state_dict
        if not getattr(original, _MARK, None):
            self._function("set_model_state_dict", original,
                           lambda a, k, r: self.point("set_model_state_dict", a[0] if a else k.get("model")))

    # after the calls ----------------------------------------------------------------------------------
    def _after_to_empty(self, args: tuple, kwargs: dict, result: Any) -> None:
        if kwargs.get("recurse", True):  # recurse=False: one piece of a materialisation someone else drives
            self.point("to_empty", args[0])

    def _after_fully_shard(self, args: tuple, kwargs: dict, result: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        module = args[0] if args else kwargs.get("module")
        if not isinstance(module, FSDPModule):  # a list of modules: one group, no root
            return
        if "forward" in self.points:
            self._first_forward(module, fsdp2=True)
        if "fully_shard" in self.points and any(isinstance(m, FSDPModule) for m in module.modules() if m is not module):
            self.point("fully_shard", module)

    def _after_fsdp1(self, args: tuple, kwargs: dict, result: Any) -> None:
        wrapper = args[0]
        if "forward" in self.points:
            self._first_forward(wrapper)
        if "FullyShardedDataParallel" in self.points:
            strategy = getattr(kwargs.get("sharding_strategy"), "name", kwargs.get("sharding_strategy"))
            self.cap.note(f"FullyShardedDataParallel(sync_module_states={bool(kwargs.get('sync_module_states'))}"
                          + (f", sharding_strategy={strategy}" if strategy else "") + ")")
            self.point("FullyShardedDataParallel", wrapper)

    def _first_forward(self, module: Any, fsdp2: bool = False) -> None:
        """A forward hook on a wrapped root that takes the ``forward`` point once and removes itself (for FSDP2,
        on every sharded module: only the one FSDP calls root at its first forward takes it)."""
        handle: list[Any] = []

        def hook(mod: Any, inputs: Any, output: Any) -> None:
            for h in handle:
                h.remove()
            if fsdp2:
                state = getattr(mod, "_get_fsdp_state", lambda: None)()
                if state is not None and not getattr(state, "_is_root", True):
                    return
            if getattr(self._local, "depth", 0) == 0:
                _guarded(self.point, "forward", mod, _outputs(output), errors=self._error)

        handle.append(module.register_forward_hook(hook))

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        _guarded(self._stepped, optimizer, errors=self._error)  # torch's hook: what it raises would be the job's

    def _stepped(self, optimizer: Any) -> None:
        n = self._steps.get(optimizer, 0) + 1
        self._steps[optimizer] = n
        if self.losses:
            self.losses.stepped()
        every = self._every(optimizer)
        self._ran, self._auto_every = max(self._ran, n), max(self._auto_every, every)
        if n == 1 or (every and n % every == 0):
            self.point(f"step{n}", owners.owner(optimizer, self._known()) or _params(optimizer))

    def _every(self, optimizer: Any) -> int:
        """The step points' interval: ``every`` where the job set it, else auto (issue 62): every step where the
        optimizer steps GPU tensors (a point costs 2-3% of a Llama-1B step on an H200, its rows made off the job's
        thread: docs/performance.md), the first step only on CPU (a point there reads every tensor on the job's
        own cores: more than a step at a real size)."""
        if self.every is not None:
            return self.every
        every = self._auto.get(optimizer)
        if every is None:
            first = next((p for g in optimizer.param_groups for p in g["params"]), None)
            every = self._auto[optimizer] = 1 if first is not None and first.is_cuda else 0
        return every

    def _loss_point(self, loss: Any) -> None:
        """The point every rank takes after the first non-finite loss (``losses.py``): the model this backward's
        loss was computed by (its graph's parameters), else the latest model the capture knows."""
        known = self._known()
        module = None
        if loss is not None:
            try:
                module = owners.of_loss(loss, known)
            except Exception as exc:  # every rank must still take the point: said in the shard, the latest model
                self._error(exc, "nonfinite_loss")
        module = module if module is not None else next((m for m in known if m is not None), None)
        self.point("nonfinite_loss", module)

    def _known(self) -> list[Any]:
        """The models the capture knows: those points probed (latest first), those to_empty materialised."""
        return [r() for r in reversed(self._roots)] + (self.materialised.roots() if self.materialised else [])

    def followed(self) -> dict[str, int]:
        """How far the step points followed the job: the optimizer steps it ran (the most of any optimizer) and
        the last step a point was taken after. A report that reads clean says where its view ended."""
        ran = self._ran
        every = self.every if self.every is not None else self._auto_every
        last = (ran // every) * every if every else 0
        return {"optimizer_steps": ran, "last_step_point": max(last, 1) if ran else 0, "every": every}

    # the point -------------------------------------------------------------------------------------------
    def point(self, name: str, module: Any, outputs: dict[str, Any] | None = None) -> None:
        """Probe ``module`` (through the wrapper: what it wraps) as point ``name``, its outputs with it."""
        if getattr(self._local, "busy", False) or getattr(self.cap, "_closed", True):
            return  # a point's own work, or a capture the script closed
        import torch

        from workbench.rank import agree

        self._local.busy = True
        try:
            inner = _unwrapped(module)
            with torch.no_grad():
                for key, tensor in (outputs or {}).items():
                    self.cap.output(key, tensor.detach())
                if outputs:  # a data-parallel root's forward: each rank's own batch, never compared with rank 0's
                    self.cap.local(*outputs)
                _found(self, inner)
                agree.wrapped(inner, owners.wrappers(inner))  # DDP's, DeepSpeed's: a replica, though probed alone
                self.cap.point(name, model=inner)
            if isinstance(inner, torch.nn.Module) and not any(r() is inner for r in self._roots):
                self._roots.append(weakref.ref(inner))
        except Exception as exc:  # the boundary of an automatic point: a line in the shard, never the job's
            self._error(exc, name)
        finally:
            self._local.busy = False

    def _error(self, exc: BaseException, where: Any = "") -> None:
        line = f"{where}: {type(exc).__name__}: {exc}"[:300]
        self.errors.append(line)
        with contextlib.suppress(AttributeError, TypeError):  # no capture (or its manifest) to say it in
            self.cap.doc.setdefault("hook_errors", []).append(line)


def _unwrapped(module: Any) -> Any:
    """What a manual point would name: the module a wrapper holds (``owners.unwrapped``), else the module itself."""
    try:
        return owners.unwrapped(module)
    except (AttributeError, TypeError, RuntimeError):  # a wrapper that does not hold what it says: itself
        return module


def _found(hooks: Hooks, inner: Any) -> None:
    """What the detectors found since the last point, for this one: the tensors to_empty clobbered under ``inner``
    (``materialise.py``), the first non-finite loss (``losses.py``: the loss as this rank's own output)."""
    for line in hooks.materialised.notes(inner) if hooks.materialised else ():
        hooks.cap.note(line)
    loss = hooks.losses.due() if hooks.losses else None
    if loss:
        hooks.cap.output("loss", loss[0]["loss"])
        hooks.cap.local("loss")
        hooks.cap.note(loss[1])


def _outputs(output: Any) -> dict[str, Any]:
    """A forward's output as named tensors: a tensor is ``output``; a dict or a transformers ``ModelOutput`` its
    tensors by key (``logits``, ``loss``); a tuple its first tensors (``output0``, ...)."""
    import torch

    if isinstance(output, torch.Tensor):
        return {"output": output}
    if isinstance(output, dict):  # ModelOutput is an OrderedDict
        return {str(k): v for k, v in output.items() if isinstance(v, torch.Tensor)}
    if isinstance(output, (tuple, list)):
        return {f"output{i}": v for i, v in enumerate(output[:4]) if isinstance(v, torch.Tensor)}
    return {}


def _params(optimizer: Any) -> dict[str, Any]:
    return {f"group{i}.param{j}": p for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])}


def _wrap_subclasses(hooks: Hooks, base: type) -> Callable[[], None]:
    """Every ``base`` subclass defined from now on that defines ``load_weights`` gets it wrapped; returns the undo."""
    previous = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        if process.STATE.hooks is hooks:
            _guarded(hooks._receiver, cls, errors=hooks._error)

    setattr(__init_subclass__, _MARK, "load_weights")
    base.__init_subclass__ = classmethod(patch.unseen(__init_subclass__))

    def undo() -> None:
        if previous is None:
            if getattr(base.__dict__.get("__init_subclass__"), "__func__", None) is __init_subclass__:
                delattr(base, "__init_subclass__")
        else:
            base.__init_subclass__ = previous

    return undo


def _guarded(fn: Callable, *args: Any, errors: Callable[[BaseException, Any], None] | None = None) -> None:
    """Run a hook's own work: whatever it raises stays out of the job (a line in the shard, or on stderr)."""
    try:
        fn(*args)
    except Exception as exc:  # the boundary between torch's hook and the job: said, never raised
        if errors is not None:
            errors(exc, getattr(fn, "__name__", "hook"))
        else:
            _say(f"workbench: a capture hook failed: {type(exc).__name__}: {exc}")


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed, full or absent stderr
        sys.__stderr__.write(line + "\n")
