"""Every collective the ledger knows, on real gloo ranks: used correctly it reads clean; one planted
mismatch reads as that op, at its call number, with both sides.

Ranks of one op pass different arguments by design (a scatter's non-source passes no list, an
all_to_all moves a different amount to each peer); the pairing compares only what travels between
each pair. The planted mismatch is rank 1's dtype (int32 for float32: the same bytes, so gloo
completes the call, corrupted, instead of dying on a size mismatch).
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb

pytestmark = pytest.mark.slow


def _ops(ctx, dt: torch.dtype) -> dict:
    """row name -> a call issuing that op; rank 1 uses ``dt``."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    r = ctx.rank
    mine = dt if r == 1 else torch.float32

    def t(*shape: int) -> torch.Tensor:
        return torch.ones(*shape, dtype=mine)

    split = (2, 2)  # all_to_all of lists: one tensor to each peer (gloo wants them all alike)

    def batch() -> None:
        ops = [dist.P2POp(dist.isend, t(4), 1 - r), dist.P2POp(dist.irecv, t(4), 1 - r)]  # both post send first
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def coalesced() -> None:
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(t(4))
            dist.all_reduce(t(2))
        cm.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(t(4)),
        "broadcast": lambda: dist.broadcast(t(4), src=1),
        "reduce": lambda: dist.reduce(t(4), dst=0),
        "scatter": lambda: dist.scatter(t(2), [t(2), t(2)] if r == 0 else None, src=0),
        "gather": lambda: dist.gather(t(4), [t(4), t(4)] if r == 0 else None, dst=0),
        "all_gather": lambda: dist.all_gather([t(4), t(4)], t(4)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(t(8), t(4)),
        "reduce_scatter": lambda: dist.reduce_scatter(t(2), [t(2), t(2)]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t(2), t(4)),
        # uneven splits: rank 0 sends 1 row to itself and 3 to rank 1, rank 1 sends 2 and 2
        "all_to_all_single": lambda: dist.all_to_all_single(
            t(3 if r == 0 else 5), t(4), output_split_sizes=[1, 2] if r == 0 else [3, 2],
            input_split_sizes=[1, 3] if r == 0 else [2, 2]),
        "all_to_all": lambda: dist.all_to_all([t(n) for n in split], [t(n) for n in split]),
        "coalesced": coalesced,
        "batch_isend_irecv": batch,
        "functional_all_gather": lambda: fc.all_gather_tensor(t(4), 0, dist.group.WORLD) + 1,
    }


OPS = ["all_reduce", "broadcast", "reduce", "scatter", "gather", "all_gather", "all_gather_into_tensor",
       "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "coalesced",
       "batch_isend_irecv", "functional_all_gather"]
READS_AS = {"coalesced": "all_reduce_coalesced", "batch_isend_irecv": "send",  # the ledger's name of the op
            "functional_all_gather": "all_gather_into_tensor"}


def _scenario(names: list[str], plant: str = "") -> wb.Scenario:
    """One step per op in ``names``; rank 1 plants an int32 for a float32 in op ``plant``."""
    sc = wb.Scenario(f"ops-{plant or 'clean'}", probe=None)
    for name in names:
        def step(ctx, name=name) -> None:
            _ops(ctx, torch.int32 if name == plant else torch.float32)[name]()
        sc.step(step, name=name)
    return sc


def test_every_op_used_correctly_reads_clean(healthy):
    s = healthy.session(_scenario(OPS))
    s.run()
    d = s.diagnose()
    assert d.clean, d.sentence
    led = s.ledger
    assert set(led["step"]) == set(OPS)
    scatter = led[led["op"] == "scatter"].set_index("rank")
    assert scatter.loc[1, "dtypes"] == "float32" and int(scatter.loc[1, "numel"]) == 2  # what the non-source gets
    assert set(led[led["step"] == "batch_isend_irecv"]["group"]) == {"0:0->1", "0:1->0"}
    assert (led[led["step"] == "functional_all_gather"]["state"] == "completed").all()  # ended at its wait_tensor


@pytest.mark.parametrize("name", OPS)
def test_one_planted_mismatch_names_the_op_the_call_and_both_sides(healthy, name):
    s = healthy.session(_scenario([name], plant=name))
    s.run()
    d = s.diagnose()
    op = READS_AS.get(name, name)
    assert d.mechanism == "collective-mismatch" and "(different dtypes)" in d.sentence, d.sentence
    assert d.step == name
    ours = s.ledger[s.ledger["step"] == name]
    seq = int(ours[ours["op"] == op]["seq"].min())
    theirs = "recv" if op == "send" else op
    assert f"rank 0: {op} #{seq} float32" in d.sentence or f"rank 0: {theirs} #{seq} float32" in d.sentence, d.sentence
    assert f"rank 1: {theirs} #{seq} int32" in d.sentence or f"rank 1: {op} #{seq} int32" in d.sentence, d.sentence
    assert "test_ledger_ops.py:" in d.sentence  # the line that issued it, not the workbench's modes


RAISES = wb.Scenario("rank-1-asserts", probe=None)


@RAISES.step
def reduce(ctx) -> None:
    import torch.distributed as dist

    for _ in range(3):
        dist.all_reduce(torch.ones(2))
    assert ctx.rank == 0, f"rank {ctx.rank} disagrees"  # rank 1 leaves before its call #4
    dist.all_reduce(torch.ones(2))


def test_a_rank_that_raises_where_the_collectives_part_leads_the_sentence(healthy):
    s = healthy.session(RAISES)
    s.step()
    d = s.diagnose()
    line = next(i for i, ln in enumerate(open(__file__), 1) if "assert ctx.rank == 0" in ln)
    assert d.mechanism == "rank-missing", d.sentence
    assert d.sentence.startswith(f"rank 1 raised AssertionError at tests/test_ledger_ops.py:{line} reduce in step "
                                 "`reduce`: rank 1 disagrees; it left rank 0 waiting: rank 1 never issued group 0 "
                                 "call #4 that rank 0 issued"), d.sentence
    assert d.ranks[0] == 1


MATMUL = wb.Scenario("rank-1-bad-batch", probe=None)


@MATMUL.step
def forward(ctx) -> None:
    import torch.distributed as dist

    dist.all_reduce(torch.ones(2))
    width = 6 if ctx.rank == 1 else 8  # rank 1's batch has the wrong width: its matmul raises inside aten
    loss = (torch.ones(4, width) @ torch.ones(8, 8)).sum()
    dist.all_reduce(loss)


def test_an_aten_error_under_the_ledgers_mode_is_a_cause_not_a_collectives_symptom(healthy):
    """The ledger's dispatch mode puts ``torch/_ops.py`` innermost in every op's traceback: a matmul's
    shape error is the rank's own cause all the same, not something a collective raised."""
    s = healthy.session(MATMUL)
    s.step()
    d = s.diagnose()
    line = next(i for i, ln in enumerate(open(__file__), 1) if "torch.ones(4, width) @" in ln)
    assert d.sentence.startswith(f"rank 1 raised RuntimeError at tests/test_ledger_ops.py:{line} forward in step "
                                 "`forward`: mat1 and mat2 shapes cannot be multiplied"), d.sentence
    assert "left rank 0 waiting" in d.sentence and d.ranks[0] == 1, d.sentence
