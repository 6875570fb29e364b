"""Attach to engines someone else launched: ``wb.connect(profile=..., cluster_id=...)``.

ipyparallel already launches engines through Slurm, MPI, SSH and friends and records a
running cluster in ``<profile>/security/cluster-<id>.json``; this module only attaches
to such a cluster and forms the process group across whatever hosts the engines are on.

Rank order (stable, documented): hosts sorted by hostname, then on each host by the
launcher's local index (``LOCAL_RANK``, ``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
``MPI_LOCALRANKID``), or by process id where no launcher set one. Each rank takes the GPU
of its local index on its host. The group's TCP store listens on 127.0.0.1 when every
engine shares one host, else on rank 0's address that routes to the other hosts (chosen
on rank 0; ``master_addr=`` or ``WORKBENCH_MASTER_ADDR`` overrides it).

``stop()`` detaches and leaves the engines running; ``shutdown()`` ends them through
ipyparallel. The workbench never relaunches an attached engine: a dead one is reported
with how to bring it back.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from workbench.errors import ClusterError
from workbench.live.cluster import Cluster
from workbench.live.engines import ipp_faults
from workbench.live.registry import (
    WAIT_S,
    cluster_file_faults,
    expected_engines,
    ipyparallel,
    load,
    peek,
    reap,
    stop_cluster,
)


class AttachedCluster(Cluster):
    """A ``Cluster`` on engines the workbench did not launch (see the module docstring)."""

    def __init__(self, profile: str | None = None, cluster_id: str = "", *, ranks: int | None = None,
                 backend: str = "auto", timeout: float = 60.0, client: Any = None, url_file: str | None = None,
                 master_addr: str | None = None, port: int | None = None, wait: float = WAIT_S):
        super().__init__(ranks=ranks or 1, backend="gloo", timeout=timeout, port=port)
        if ranks is not None and ranks < 1:
            raise ClusterError(f"ranks must be >= 1, got {ranks}")
        self.profile, self.cluster_id, self.ranks_wish = profile, cluster_id, ranks
        self.backend_wish, self.master_wish, self.wait = backend, master_addr, wait
        self._given_client, self._url_file = client, url_file
        self.hosts: dict[int, str] = {}
        self._ipc = None  # the ipp.Cluster read from the cluster file, when attached by profile (read when needed)
        self._by_profile = False  # attached through a profile's cluster file
        self._reach: dict[str, tuple[float, bool]] = {}  # host -> (when probed, unreachable)

    @property
    def where(self) -> str:
        if self._given_client is not None:
            return "a given client"
        if self._url_file:
            return self._url_file
        return f"profile {self.profile or 'default'!r}" + (f" id {self.cluster_id!r}" if self.cluster_id else "")

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> AttachedCluster:
        """Attach: connect, order the engines into ranks, form the group."""
        t0 = time.perf_counter()
        self._connect()
        attached = False
        try:
            t1 = time.perf_counter()
            self._take_ranks()
            self.start_s, self.imports_s = t1 - t0, time.perf_counter() - t1
            self.form_group()
            attached = True
        finally:
            if not attached:  # whatever stopped it (Ctrl-C too), the caller never gets this object: detach
                self.stop()
        return self

    def _connect(self) -> None:
        ipp = ipyparallel()

        expected = None
        try:
            if self._given_client is not None:
                self._client = self._given_client
            elif self._url_file:
                if not os.path.isfile(self._url_file):
                    raise ClusterError(f"no connection file {self._url_file}")
                self._client = ipp.Client(self._url_file, timeout=10)
            else:
                # Local processes all running (`up`, `ipcluster start`): the file's two numbers suffice. Else
                # ipyparallel's own reading; not strict: a controller on another host (a Slurm job's batch host)
                # is no local process.
                seen = peek(self.profile, self.cluster_id)
                self._by_profile = True
                if seen is None:
                    self._ipc = load(self.profile, self.cluster_id, strict=False)
                    pdir, expected, running = self._ipc.profile_dir, expected_engines(self._ipc), \
                        self._ipc.controller is not None
                else:
                    (pdir, expected), running = seen, True
                try:
                    self._client = ipp.Client(profile_dir=pdir, cluster_id=self.cluster_id,
                                              timeout=10 if running else 5)
                except ipp_faults():
                    if not running:
                        raise ClusterError(f"the controller of {self.where} does not answer and is no process on "
                                           "this host (a stale cluster file?); `workbench down --profile "
                                           f"{self.profile or 'default'}` clears it") from None
                    raise
        except (*ipp_faults(), *cluster_file_faults()) as exc:  # the wire's, or a connection file it cannot read
            raise ClusterError(f"could not connect to {self.where}: {exc}") from None
        want = self.ranks_wish or expected
        if self.ranks_wish and expected is not None and expected < self.ranks_wish:
            self.stop()
            raise ClusterError(f"{self.where} has {expected} engine(s), fewer than the {self.ranks_wish} ranks asked")
        end = time.monotonic() + self.wait
        while want and len(self._client.ids) < want and time.monotonic() < end:
            time.sleep(0.1)
        have = len(self._client.ids)
        if want and have < want:
            self.stop()
            if expected is not None and have < expected:
                raise ClusterError(f"only {have} of the {expected} engines of {self.where} are up after "
                                   f"{self.wait:g}s; the rest may still be starting: retry in a moment")
            raise ClusterError(f"{self.where} has {have} engine(s), fewer than the {want} ranks asked")
        if not have:
            self.stop()
            raise ClusterError(f"{self.where} has no engines registered")

    def _take_ranks(self) -> None:
        from workbench.rank.host import order, pick_backend, whoami

        ids = sorted(self._client.ids)
        self._client[ids].use_cloudpickle()
        ar = self._client[ids].apply_async(whoami)
        try:
            infos = dict(zip(ids, ar.get(timeout=self.deadline)))
        except ipp_faults() as exc:
            raise ClusterError(f"the engines of {self.where} did not answer: {exc}") from None
        ranked = order(infos)[: self.ranks_wish or len(ids)]
        self._import_rank_layer([e for e, _ in ranked])
        self.world_size = len(ranked)
        self._ids = [e for e, _ in ranked]
        self.local_index = {r: li for r, (_, li) in enumerate(ranked)}
        self.info = {r: infos[e] for r, (e, _) in enumerate(ranked)}
        self.pids = {r: i["pid"] for r, i in self.info.items()}
        self.hosts = {r: i["host"] for r, i in self.info.items()}
        self.backend = pick_backend(self.backend_wish, list(self.info.values()), list(self.local_index.values()))

    def _import_rank_layer(self, ids: list[int]) -> None:
        """Import torch and the rank layer on engines fresh from their launcher before the group forms: on a
        loaded host 4 engines importing torch at once outlast the group's deadline (seen in the namespace tests)."""
        from workbench.live.engines import _import_rank_layer
        from workbench.live.registry import UP_TIMEOUT_S

        try:
            self._client[ids].apply_async(_import_rank_layer).get(timeout=UP_TIMEOUT_S)
        except ipp_faults() as exc:
            raise ClusterError(f"the engines of {self.where} could not import the workbench: {exc}") from None

    def _rendezvous(self) -> tuple[str, int]:
        from workbench.rank.host import free_port, rendezvous_addr

        addr = self.master_wish or os.environ.get("WORKBENCH_MASTER_ADDR")
        if not addr:
            if len(set(self.hosts.values())) == 1:
                addr = "127.0.0.1"
            else:
                peers = [a for r, i in self.info.items() if i["host"] != self.hosts[0] for a in i["addrs"]]
                addr = self._view(0).apply_async(rendezvous_addr, peers).get(timeout=self.deadline)
        port = self._port_wish or self._view(0).apply_async(free_port, addr).get(timeout=self.deadline)
        return addr, port

    def _set_threads(self) -> None:
        from workbench.rank.host import set_threads

        per_host = {h: list(self.hosts.values()).count(h) for h in set(self.hosts.values())}
        for n in set(per_host.values()):
            self.run(set_threads, n, ranks=[r for r, h in self.hosts.items() if per_host[h] == n])

    def stop(self) -> None:
        """Detach: the engines stay up for the next attach (``shutdown()`` ends them)."""
        if self._client is not None and self._given_client is None:
            try:
                self._client.close()
            except ipp_faults():
                pass  # a connection already broken: nothing left to close
        self._client = None
        self._busy.clear()
        self._dead.clear()

    def shutdown(self) -> None:
        """End the engines and their controller through ipyparallel (what ``workbench down`` does)."""
        here = socket.gethostname()
        if self._by_profile and self._ipc is None:
            try:
                self._ipc = load(self.profile, self.cluster_id, strict=False)
            except ClusterError:
                pass  # its file is gone: through the controller, as for a given client
        if self._ipc is not None and self._ipc.controller is not None and all(h == here for h in self.hosts.values()):
            self.stop()  # all on this host: the recorded pids are ours to end
            stop_cluster(self._ipc, self.pids.values())
            return
        if self._client is None:
            self._connect()
        local = [p for r, p in self.pids.items() if self.hosts.get(r) == here]
        client = self._client
        if not _within(SHUTDOWN_ANSWER_S, lambda: client.shutdown(targets="all", hub=True, block=True)):
            # ipyparallel waits for every engine's reply before it asks the hub, without a bound: an engine that
            # never answers (frozen, or its reply lost as it exited) held this for ever. The local ones are ended
            # below; the hub is asked alone (ipyparallel's own request, the step its shutdown did not reach).
            warnings.warn(f"workbench: not every engine answered ipyparallel's shutdown within "
                          f"{SHUTDOWN_ANSWER_S:g}s; the local engines are ended and the controller asked alone",
                          stacklevel=2)
            reap(local, timeout=0)
            _within(SHUTDOWN_ANSWER_S, lambda: client._send_recv(client._query_stream, "shutdown_request"))
        self.stop()
        reap(local)
        if self._ipc is not None and all(h == here for h in self.hosts.values()):
            self._ipc.remove_cluster_file()

    def restart(self) -> AttachedCluster:
        """Re-attach and re-form the group on the same engines; a dead one cannot come back from here."""
        dead = self.dead_ranks() if self.alive else []
        if dead:
            raise ClusterError(self.revive_line(dead))
        self.stop()
        return self.start()

    def revive_line(self, dead: list[int]) -> str:
        """One line: which ranks are gone (a host that is unreachable named as such) and the way back."""
        gone = []
        for host in sorted({self.hosts.get(r, "?") for r in dead}):
            on = [r for r in dead if self.hosts.get(r) == host]
            if self._unreachable(host):
                gone.append(f"host {host} is unreachable (rank{'s' if len(on) > 1 else ''} "
                            f"{', '.join(map(str, on))}: no heartbeat to the controller, no answer from "
                            f"{self.controls.get(on[0], {}).get('host', 'its control thread')})")
            else:
                gone.append(", ".join(f"rank {r} (pid {self.pids.get(r)} on {host})" for r in on) + " died")
        return "; ".join(gone) + f"; {self._way_back()}"

    def _way_back(self) -> str:
        how = (f"`workbench down --profile {self.profile or 'default'}` then `workbench up --ranks {self.world_size}"
               f" --profile {self.profile or 'default'}`, or your ipcluster/Slurm job") if self._by_profile \
            else "the launcher that started it (ipcluster, Slurm, mpiexec)"
        return (f"the workbench did not launch these engines, so it cannot restart them: "
                f"bring them back with {how}, then wb.connect(...) again")

    def death_line(self, rank: int) -> str:
        """A rank gone from the controller: its engine died, or its whole host dropped off the network."""
        return self.revive_line([rank])

    def _unreachable(self, host: str) -> bool:
        """No rank of ``host`` answers at its control port, not even with a refusal (a dead engine's port
        refuses at once; a host off the network stays silent). Cached for a few seconds: one probe per host."""
        from workbench.rank.control import ask

        if host == socket.gethostname():
            return False
        seen = self._reach.get(host)
        if seen is not None and time.monotonic() - seen[0] < 3.0:
            return seen[1]
        ranks = [r for r, h in self.hosts.items() if h == host and self.controls.get(r)]
        silent = bool(ranks)
        for r in ranks:
            err = ask(self.controls[r], "ping", 1.0).get("error", "")
            if not err or "Refused" in err:  # it answers, or its host says nothing listens there
                silent = False
                break
        self._reach[host] = (time.monotonic(), silent)
        return silent

    def _check_usable(self) -> None:
        if self._client is not None:
            dead = sorted(set(self.dead_ranks()) | self._dead)
            if dead:
                self._dead.update(dead)
                raise ClusterError(self.revive_line(dead))
        super()._check_usable()

    def is_local(self, rank: int) -> bool:
        return self.hosts.get(rank) == socket.gethostname()

    def session(self, scenario: Any, fix: str | None = None, poison: bool = True, **params: Any) -> Any:
        """A session whose ledger reads include ranks on other hosts (live/mirror.py says why)."""
        from workbench.live.mirror import mirror_before_poll

        s = super().session(scenario, fix=fix, poison=poison, **params)
        mirror_before_poll(self, s)
        return s

    def dead_ranks(self) -> list[int]:
        """Local engines by their process; engines on other hosts by the controller's registry."""
        here = socket.gethostname()
        dead = [r for r in super().dead_ranks() if self.hosts.get(r) == here]
        if any(h != here for h in self.hosts.values()) and self._client is not None:
            ids = set(self._client.ids)
            dead += [r for r, h in self.hosts.items() if h != here and self._ids[r] not in ids]
        return sorted(dead)

    def __repr__(self) -> str:
        hosts = len(set(self.hosts.values()))
        return super().__repr__()[:-1] + f" attached to {self.where}, {hosts} host(s)>"


# A hub registers an engine once it has seen its heartbeat: a controller the user started with the default
# 3 s ping took ~10 s for the job's engines (measured), where rank 0's own (``--ping=500``) takes ~0.2 s.
SHUTDOWN_ANSWER_S = 15.0  # engines and hub answer a shutdown in well under a second; this is for one that never does


def _within(seconds: float, fn: Callable[[], Any]) -> bool:
    """Whether ``fn`` returned (or raised) within ``seconds``. It runs on a daemon thread, which a wait that never
    ends leaves behind, blocked; the caller goes on."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:  # a thread's boundary: whether fn returned is all the caller asks, not how it failed
            pass
        finally:
            done.set()

    threading.Thread(target=run, name="wb-shutdown", daemon=True).start()
    return done.wait(seconds)


JOB_WAIT_S = 30.0


class JobCluster(AttachedCluster):
    """The ranks of the user's own job at ``cap.breakpoint()`` (``workbench/job/engine.py``): the engines run
    inside the job's processes, so the job's own process group and rank order are used as they are (no group
    is formed or re-formed here); ``resume()`` hands the ranks back to the script."""

    def __init__(self, job: str | os.PathLike, *, timeout: float = 60.0, wait: float = JOB_WAIT_S):
        from workbench.job.engine import ATTACH

        self.job_dir = os.fspath(job)
        path = os.path.join(self.job_dir, ATTACH)
        try:
            with open(path) as f:
                self.attach_doc = json.load(f)
        except (OSError, ValueError):
            raise ClusterError(f"nothing to attach to in {self.job_dir} (no readable {ATTACH}): is the job at "
                               "cap.breakpoint(), or did a rank raise under capture(attach='on-error')?") from None
        if self.attach_doc.get("status") != "waiting":
            raise ClusterError(f"the job in {self.job_dir} is not attachable now (its {ATTACH} says "
                               f"{self.attach_doc.get('status')!r}, by {self.attach_doc.get('by')!r})")
        pid, host = self.attach_doc.get("pid"), self.attach_doc.get("host")
        if pid and host == socket.gethostname() and not _alive(pid):
            raise ClusterError(f"the job in {self.job_dir} is gone (its rank 0, pid {pid}, exited at the breakpoint)")
        late = time.time() - float(self.attach_doc.get("deadline_at") or time.time())
        if late > 5:
            raise ClusterError(f"the breakpoint of the job in {self.job_dir} passed its deadline {late:.0f}s ago; "
                               "the ranks went on (or the job died there)")
        super().__init__(ranks=int(self.attach_doc["world_size"]), timeout=timeout,
                         url_file=self.attach_doc["client_file"], wait=wait)
        self.resumed: dict[str, Any] | None = None
        # post mortem (``capture(attach=...)``): which rank raised and where, where each other rank waits, or the
        # deadlock's proof (which call on which rank); ``line`` says it in one line. None at a breakpoint.
        self.post_mortem: dict[str, Any] | None = self.attach_doc.get("post_mortem")

    @property
    def where(self) -> str:
        return f"the job at {self.job_dir}"

    def _take_ranks(self) -> None:
        from workbench.job.engine import whoami

        ids = sorted(self._client.ids)
        self._client[ids].use_cloudpickle()
        asked = {e: self._client[e].apply_async(whoami) for e in ids}
        end = time.monotonic() + self.deadline
        while not all(ar.ready() for ar in asked.values()) and time.monotonic() < end:
            time.sleep(0.02)
        infos = {}
        for e, ar in asked.items():  # a controller the user named may hold other engines: only this breakpoint's
            with contextlib.suppress(*ipp_faults(), AttributeError):  # no answer yet, or another engine's reply
                info = ar.get(timeout=0)
                if (info.get("job"), info.get("breakpoint")) == (self.attach_doc.get("job"),
                                                                  self.attach_doc.get("breakpoint")):
                    infos[e] = info
        if not infos:
            raise ClusterError(f"no engine of {self.where} answered within {self.deadline:g}s")
        by_rank = {i["rank"]: e for e, i in infos.items()}
        world = next(iter(infos.values()))["world_size"]
        if sorted(by_rank) != list(range(world)):
            raise ClusterError(f"{self.where}: engines of ranks {sorted(by_rank)} registered, expected 0..{world - 1}")
        self.world_size = world
        self._ids = [by_rank[r] for r in range(world)]
        self.info = {r: infos[e] for r, e in enumerate(self._ids)}
        self.local_index = {r: i["local_rank"] for r, i in self.info.items()}
        self.pids = {r: i["pid"] for r, i in self.info.items()}
        self.hosts = {r: i["host"] for r, i in self.info.items()}
        self.backend = self.info[0]["backend"] or "gloo"
        self.names = {r: i["names"] for r, i in self.info.items()}  # rank -> the names its namespace offers
        self.controls = {r: i.get("control") for r, i in self.info.items()}  # cluster.stacks() while a cell hangs

    def form_group(self) -> None:
        """The job's own group serves as it is: nothing to form."""
        self.dirty = False
        self.generation += 1
        self.group_s = 0.0

    def session(self, scenario: Any, fix: str | None = None, poison: bool = True, **params: Any) -> Any:
        raise ClusterError("a job at a breakpoint runs its own script, not a scenario: use cluster.run(fn), "
                           "cluster.probe(...) and %%px cells, then cluster.resume()")

    def restart(self) -> AttachedCluster:
        raise ClusterError("the workbench cannot restart the ranks of your own job; cluster.resume() hands them "
                           "back to the script")

    def recover(self, wait: float | None = None) -> dict[str, Any]:
        raise ClusterError("the workbench cannot re-form your job's process group; wait for the stuck call to "
                           "return, or cluster.resume() once it has")

    def shutdown(self) -> None:
        """Never ends the job's processes: resumes them."""
        self.resume()

    def resume(self, wait: float = 60.0) -> dict[str, Any]:
        """Hand every rank back to the script (``cap.breakpoint()`` returns there) and detach; waits until the
        job's ``attach.json`` says resumed. Returns it, with ``resume_s`` (from the call to that). Post mortem:
        the rank that raised then fails with its exception (the launcher ends the others); after a deadlock
        every rank ends at once (exit status 1, one line each) rather than at its group's timeout."""
        from workbench.job.engine import ATTACH
        from workbench.job.engine import resume as resume_rank

        if self._client is None:
            raise ClusterError(f"not attached to {self.where}")
        t0 = time.perf_counter()
        try:
            self._client[self._ids].apply_async(resume_rank).get(timeout=self.deadline)
        except ipp_faults() as exc:
            raise ClusterError(f"the ranks of {self.where} did not take the resume: {exc}") from None
        path = os.path.join(self.job_dir, ATTACH)
        end = time.monotonic() + wait
        doc: dict[str, Any] = {}
        while time.monotonic() < end:
            with contextlib.suppress(OSError, ValueError):
                with open(path) as f:
                    doc = json.load(f)
                if doc.get("status") != "waiting":
                    break
            time.sleep(0.05)
        self.stop()
        if doc.get("status") != "resumed":
            raise ClusterError(f"the ranks of {self.where} took the resume but the job did not say it went on "
                               f"within {wait:g}s (its {ATTACH}: {doc.get('status')!r})")
        self.resumed = {**doc, "resume_s": time.perf_counter() - t0}
        return self.resumed

    def probe(self, *names: str) -> Any:
        """Probe ``names`` in every rank's namespace: one DataFrame of the rows of every rank that answered. A rank
        whose device cannot be read (post mortem on NCCL: held behind a collective that never completes) answers
        with its last point's rows from its shard, labelled in the ``as_of`` column (``point X``); a rank that
        does not answer at all has no rows. Either way one line per such rank, in ``df.attrs["problems"]`` and
        the log; this never fails as a whole while one rank answered."""
        import logging

        from workbench.analysis.frames import COLUMNS, table
        from workbench.job.engine import probe_here

        self._check_usable()
        asked = {r: self._client[self._ids[r]].apply_async(probe_here, list(names)) for r in range(self.world_size)}
        end = time.monotonic() + self.deadline
        rows: list[dict[str, Any]] = []
        lines: list[str] = []
        for r, ar in asked.items():
            try:
                got = ar.get(timeout=max(0.1, end - time.monotonic()))
            except ipp_faults() as exc:
                why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
                lines.append(f"rank {r}: no rows (it did not answer: {why})")
                continue
            if "error" in got:
                lines.append(f"rank {r}: no rows ({got['error']})")
                continue
            rows += got["rows"]
            if got.get("as_of") is not None:
                lines.append(f"rank {r}: rows as of point {got['as_of']!r} from its shard (its device did not "
                             f"answer now: {got.get('why')})")
        if not rows:
            raise ClusterError(f"no rank of {self.where} gave rows for {list(names)}: " + "; ".join(lines)
                               if lines else f"no variable(s) {list(names)} on the ranks of {self.where}")
        missing = set(names) - {r["name"].split(".")[0] for r in rows}
        if missing:
            lines.append(f"no variable(s) {sorted(missing)} on any rank")
        df = table(rows, COLUMNS)
        df.attrs["problems"] = lines
        for line in lines:
            logging.getLogger("workbench").warning("workbench: probe: %s", line)
        return df

    def __repr__(self) -> str:
        state = "resumed" if self.resumed else "attached" if self._client is not None else "detached"
        pm = f", post mortem: {self.post_mortem.get('line')}" if self.post_mortem else ""
        per_rank = getattr(self, "names", {}) or {}
        common = sorted(set.intersection(*(set(n) for n in per_rank.values()))) if per_rank else []
        extra = "".join(f"; rank {r} also {', '.join(sorted(set(n) - set(common)))}"
                        for r, n in sorted(per_rank.items()) if set(n) - set(common))
        return (f"<JobCluster ranks={self.world_size} backend={self.backend} {state} to the job at {self.job_dir}, "
                f"point {self.attach_doc.get('point')!r}, names {', '.join(common)}{extra}{pm}>")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def connect(profile: str | None = None, cluster_id: str = "", *, ranks: int | None = None, backend: str = "auto",
            timeout: float = 60.0, client: Any = None, url_file: str | None = None,
            master_addr: str | None = None, wait: float = WAIT_S, job: str | os.PathLike | None = None
            ) -> AttachedCluster:
    """Attach to a running ipyparallel cluster (by profile and cluster id, a connection file, or an
    ``ipp.Client``) and form the process group over its engines; ``ranks`` takes the first N in rank order.
    ``job=<capture dir>``: the ranks of your own job at ``cap.breakpoint()``, over the job's own group
    (``JobCluster``; ``cluster.resume()`` hands them back)."""
    if job is not None:
        return JobCluster(job, timeout=timeout, wait=max(wait, JOB_WAIT_S)).start()
    return AttachedCluster(profile, cluster_id, ranks=ranks, backend=backend, timeout=timeout, client=client,
                           url_file=url_file, master_addr=master_addr, wait=wait).start()
