"""What an engine does per call, and no more: its stdout/stderr skip ipykernel's empty flushes
(``workbench.rank.outstream``) and print as before; its log writes no line per request; it starts no
nanny process beside it.

Real engines (the session's shared cluster): a spy on each stream counts the flushes that reach the IOPub thread
while the ranks run calls that print nothing, then while one prints.
"""

from __future__ import annotations


def _spy() -> None:
    import sys

    for s in (sys.stdout, sys.stderr):
        s._wb_flushes = 0
        real = type(s)._flush

        def counted(s=s, real=real):
            s._wb_flushes += 1
            real(s)

        s._flush = counted  # what a flush hands the IOPub thread


def _read() -> int:
    import sys

    n = 0
    for s in (sys.stdout, sys.stderr):
        n += s._wb_flushes
        del s._flush, s._wb_flushes
    return n


def _quiet() -> int:
    return 1


def _loud(rank_text: str) -> int:
    print(rank_text)
    return 2


def test_a_call_that_prints_nothing_hands_the_iopub_thread_no_flush(healthy):
    healthy.run(_spy)
    for _ in range(3):
        healthy.run(_quiet)
    # ipykernel's own stream flushed stdout and stderr twice each per call: 12+ here
    assert healthy.run(_read) == {r: 0 for r in range(healthy.world_size)}


def test_what_a_rank_prints_still_arrives_with_its_call(healthy):
    healthy.run(_spy)
    view = healthy._client[healthy._ids]
    ar = view.apply_async(_loud, "printed on a rank")
    assert ar.get(timeout=60) == [2] * healthy.world_size
    ar.wait_for_output(timeout=30)  # output and reply travel apart (IOPub, the call's own socket)
    assert ar.stdout == ["printed on a rank\n"] * healthy.world_size
    assert all(n > 0 for n in healthy.run(_read).values())


def _log_levels() -> list[int]:
    from ipyparallel.engine.app import IPEngine

    return [h.level for h in IPEngine.instance().kernel.log.handlers]


def test_an_engine_logs_warnings_not_a_line_per_request(healthy):
    import logging

    for levels in healthy.run(_log_levels).values():  # ipyparallel's INFO wrote and flushed "Handling apply_request"
        assert levels and min(levels) >= logging.WARNING


def test_an_engine_starts_no_nanny_beside_it(healthy):
    """ipyparallel's nanny (one more Python process per engine, ~0.6 CPU-s to start on the 2-core box) relays
    single-engine signals and reports an engine's exit early; the workbench signals no single engine through it,
    and tells a dead rank by its pid (``dead_ranks``)."""
    import psutil

    for rank, pid in healthy.pids.items():
        kids = [" ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)]
        assert not [k for k in kids if "nanny" in k], (rank, kids)
