"""Today's probe rows are byte-identical to the rows of the probe before the packed path.

`benchmarks/probe_reference.py` is that probe, frozen (main 06518e8). On CPU both take the plain
path; through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when
the kernels are defined) both take their fused kernels on CPU tensors, the reference its
per-dtype launches, today's probe one launch over a cached plan. The GPU comparison runs in
`benchmarks/probe_scale.py`. Equality is of the pickled rows: every value, every bit.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import probe_reference as ref  # noqa: E402

from workbench.rank import probe  # noqa: E402
from workbench.rank.poison import poison_  # noqa: E402


def mixed_model() -> nn.Module:
    """Every dtype and shape the probe tells apart: fusable sizes on both sides of a block, odd sizes,
    doubles, integers, an empty tensor, a non-contiguous view, a shared parameter, NaN, Inf and poison."""
    g = torch.Generator().manual_seed(0)
    m = nn.Module()
    m.a = nn.Linear(40, 30).to(torch.bfloat16)
    m.b = nn.Linear(8, 3).half()
    m.c = nn.Module()
    m.c.w = nn.Parameter(torch.randn(3000, generator=g).to(torch.bfloat16))  # 3 blocks at the test's size
    m.c.f = nn.Parameter(torch.randn(2000, generator=g))  # 4 blocks
    m.c.odd = nn.Parameter(torch.randn(3, generator=g).to(torch.bfloat16))  # 6 bytes: not whole words
    m.c.tiny = nn.Parameter(torch.tensor([1.5, -2.0], dtype=torch.float16))  # one word, head shorter than 8
    m.register_buffer("steps", torch.arange(5))
    m.register_buffer("d", torch.randn(33, generator=g, dtype=torch.float64))
    m.register_buffer("empty", torch.zeros(0))
    m.register_buffer("scratch", torch.randn(6, 5, generator=g).t(), persistent=False)  # not contiguous
    m.shared = m.a  # a module reached twice: its tensors once
    with torch.no_grad():
        m.c.w.view(-1)[2000] = float("nan")  # in the second block
        m.c.f.view(-1)[7] = float("inf")
        poison_(m.b.weight.data)
        m.b.weight.data.view(-1)[:3] = 0.5
    return m


def fusable_model() -> nn.Module:
    """Only fusable tensors: the packed path with its cached plan."""
    g = torch.Generator().manual_seed(1)
    m = nn.Sequential(nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 6)).to(torch.bfloat16)
    m.register_buffer("inv_freq", torch.rand(32, generator=g))  # fp32 beside bf16: one launch, two kinds
    with torch.no_grad():
        m[0].weight.view(-1)[9] = float("-inf")
        m[2].bias.view(-1)[1] = float("nan")
    return m


def _sumsq(t: torch.Tensor) -> float:
    x = t.detach().reshape(-1).double()
    return float(torch.where(torch.isfinite(x), x, 0.0).square().sum())


def pop_sumsq(module: nn.Module, rows: list[dict]) -> None:
    """``sumsq`` came after the reference: every row has it, near the float64 sum of the finite values' squares
    (the fused pass sums a block's lanes in fp32), and the rest of the row is the reference's."""
    tensors = {n: t for n, _, t in probe.named_tensors(module)}
    for r in rows:
        got = r.pop("sumsq")
        if r["fingerprint"] in ("meta", "empty"):
            assert got is None
            continue
        want = _sumsq(tensors[r["name"]])
        assert abs(got - want) <= 1e-6 * max(want, 1e-30), (r["name"], got, want)


def same_rows(module: nn.Module) -> None:
    new, old = probe.probe_module(module, rank=1), ref.probe_module(module, rank=1)
    pop_sumsq(module, new)
    assert [r["name"] for r in new] == [r["name"] for r in old]
    for a, b in zip(new, old):
        assert pickle.dumps(a) == pickle.dumps(b), (a["name"], {k: (a[k], b[k]) for k in a if a[k] != b[k]})
    assert pickle.dumps(new) == pickle.dumps(old)


def test_plain_path_rows_are_the_references_bytes():
    same_rows(mixed_model())
    same_rows(fusable_model())


def tied_model() -> nn.Module:
    """A head tied to the embedding (one parameter, two names) and a second name for one buffer's memory."""
    m = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)).to(torch.bfloat16)
    m[1].weight = m[0].weight
    m.register_buffer("inv_freq", torch.rand(32, generator=torch.Generator().manual_seed(2)))
    m.register_buffer("alias", m.inv_freq, persistent=False)
    return m


def tied_rows(module: nn.Module) -> None:
    """A tied module's rows: the reference's bytes plus ``shares`` on the rows whose tensor has other names."""
    new, old = probe.probe_module(module, rank=1), ref.probe_module(module, rank=1)
    pop_sumsq(module, new)
    shares = {r["name"]: r.pop("shares") for r in new if "shares" in r}
    assert shares == {"0.weight": "1.weight", "inv_freq": "alias", "alias": "inv_freq"}, shares
    assert pickle.dumps(new) == pickle.dumps(old)


def test_a_tie_is_recorded_and_every_other_byte_stays_the_references():
    tied_rows(tied_model())


def _interpreted() -> None:
    """Run with TRITON_INTERPRET=1: both probes' fused kernels on CPU tensors."""
    from workbench.rank import probe_fused

    probe_fused.FUSED_DEVICES = ref.FUSED_DEVICES = ("cuda", "cpu")
    probe_fused.WORDS_PER_ITER = ref.WORDS_PER_ITER = 256  # small blocks: many programs, a quick interpreter
    probe_fused.ITERS = ref.ITERS = 2
    m = fusable_model()
    same_rows(m)  # builds the plan
    plan = probe._PLANS[m][1][0]
    with torch.no_grad():
        m[0].weight.view(-1)[3] = 7.0  # new values, same plan
    same_rows(m)
    assert probe._PLANS[m][1][0] is plan
    m[2].weight.data = torch.ones(6, 48, dtype=torch.bfloat16)  # new storage: a new plan
    same_rows(m)
    assert probe._PLANS[m][1][0] is not plan
    plan = probe._PLANS[m][1][0]
    m.register_buffer("extra", torch.rand(8))  # every old tensor alive where it was: launched early, then
    same_rows(m)  # the key differs (a new buffer), so the plan is rebuilt and launched again
    assert probe._PLANS[m][1][0] is not plan and probe._PLANS[m][1][1][-1][0] == "extra"
    changes = (  # each leaves every other tensor where it was; the cached plan must not be the one read
        lambda m: setattr(m[2], "weight", nn.Parameter(m[2].weight.detach().clone())),  # a parameter swapped
        lambda m: m.to(torch.float32),  # the same parameters (``p.data = ...``), new dtype and memory
        lambda m: m.__setitem__(1, nn.LayerNorm(48)),  # a child swapped
        lambda m: m.register_buffer("extra", m.extra, persistent=False),  # the same buffer, now non-persistent
        # the same names and objects in the same order, one dict over: read as one list they did not change
        lambda m: m[1]._buffers.__setitem__("bias", m[1]._parameters.pop("bias")),  # a parameter now a buffer
        lambda m: setattr(m[1], "bias", None),  # a parameter set to None
    )
    for change in changes:
        plan = probe._PLANS[m][1][0]
        change(m)
        same_rows(m)
        assert probe._PLANS[m][1][0] is not plan
    split, shares = probe_fused.SPLIT_BYTES, probe_fused.SPLIT_SHARES
    probe_fused.SPLIT_BYTES = 0  # every module in two launches: the rows in the same order, the same bytes
    try:
        same_rows(fusable_model())
        assert len(probe._PLANS[m][1][0].parts) == 1  # built before: one launch
        tied_rows(tied_model())
        big = fusable_model()
        same_rows(big)
        # the largest tensors that hold half the bytes go last (0.weight: 6144 of 7148)
        assert [at for _, at in probe._PLANS[big][1][0].parts] == [[1, 2, 3, 4, 5, 6], [0]]
        probe_fused.SPLIT_SHARES = (0.5, 0.9)  # three launches: 0.weight, then 2.weight (576), then the rest
        three = fusable_model()
        same_rows(three)
        assert [at for _, at in probe._PLANS[three][1][0].parts] == [[1, 2, 3, 5, 6], [4], [0]]
    finally:
        probe_fused.SPLIT_BYTES, probe_fused.SPLIT_SHARES = split, shares
    gone = weakref.ref(m)
    del m, plan
    gc.collect()
    assert gone() is None, "the plan cache kept its module alive"
    same_rows(mixed_model())  # the general path: fused members in one launch beside the plain ones
    tied = tied_model()
    tied_rows(tied)  # the packed path: ties known when its plan is built
    tied_rows(tied)  # ... and from the cached plan
    dtensor_rows()
    print("interpreted rows identical")


def dtensor_rows() -> None:
    """An FSDP2 model (its parameters DTensors, its tied head one of them) takes the packed path and reads as the
    general path reads it, byte for byte: local shapes, statistics, the layout, the shares; and its held pairs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        m = tied_model()
        fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
        assert type(m[0].weight).__name__ == "DTensor"
        ties: dict = {}
        same: dict = {}
        general = probe.probe_tensors(probe.named_tensors(m, "", ties), 1, None, None, same)
        probe._mark_shares(general, ties, same)
        held: list = []
        packed = probe.probe_module(m, rank=1, held=held)
        assert probe._PLANS.get(m) is not None and probe._PLANS[m][1] is not None, "the packed path refused DTensors"
        assert pickle.dumps(packed) == pickle.dumps(general), (packed[0], general[0])
        assert packed[0]["placement"].endswith(" on mesh 1") and packed[0]["global_shape"] == "16x8"
        assert [n for n, _ in held] == [n for n, _, _ in probe.named_tensors(m)]
        stamp = probe.plan_stamp({"model": m, "other": 3})
        assert pickle.dumps(probe.probe_module(m, rank=1)) == pickle.dumps(general)  # from the cached plan
        assert probe.plan_stamp({"model": m}) == stamp  # the same plan vouches: agree's walk is reused
        m.register_buffer("extra", torch.zeros(4))
        probe.probe_module(m, rank=1)
        assert probe.plan_stamp({"model": m}) not in (stamp, None)  # a new tree: a new plan, a new stamp
        assert probe.plan_stamp({"model": m, "plain": nn.Linear(2, 2)}) is None  # a module without a plan
    finally:
        dist.destroy_process_group()


def test_fused_rows_through_the_interpreter_are_the_references_bytes():
    pytest.importorskip("triton")
    code = f"import runpy; runpy.run_path({str(Path(__file__))!r}, run_name='__interpreted__')"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=580)
    assert out.returncode == 0 and "interpreted rows identical" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


if __name__ == "__interpreted__":
    _interpreted()


def test_a_plan_is_reused_only_for_the_same_addresses_sizes_and_dtypes():
    """``probe_fused.plan_for``: a job's logits are a new tensor every step, mostly where the last ones were; their
    plan (descriptor table, buffers, host constants) is reused only when every tensor's address, size and dtype
    are the ones it was built for."""
    from workbench.rank import probe_fused

    a, b = torch.zeros(300), torch.zeros(64, dtype=torch.bfloat16)
    plan = probe_fused.plan_for([a, b])
    assert probe_fused.plan_for([a, b]) is plan
    assert probe_fused.plan_for([a.view(torch.int32).view(torch.float32), b]) is plan  # same memory, same reading
    assert probe_fused.plan_for([a[:200], b]) is not plan  # fewer elements
    assert probe_fused.plan_for([torch.zeros(300), b]) is not plan  # another address
    assert probe_fused.plan_for([a.view(torch.bfloat16), b]) is not plan  # another dtype
    assert probe_fused.plan_for([b, a]) is not plan  # another order: another descriptor table
    for i in range(20):  # the cache keeps the newest
        probe_fused.plan_for([torch.zeros(8 + i)])
    assert len(probe_fused._PLAN_CACHE) <= 16 and probe_fused.plan_for([a, b]) is not plan


def test_the_plain_paths_sum_of_squares_rides_in_its_one_copy():
    """On a GPU the plain path's sum of squares is the ninth value of the tensor's device stats (one copy back for
    all, no sync a tensor): the float64 sum of the finite values' squares, as the per-tensor reduction gave it. On
    CPU the slot is 0 and the batched CPU pass gives it (``probe_cpu.sumsq``)."""
    g = torch.Generator().manual_seed(3)
    cases = {dtype: torch.randn(257, generator=g).to(dtype) for dtype in (torch.bfloat16, torch.float32, torch.float64)}
    cases[torch.float32][[4, 9]] = torch.tensor([float("nan"), float("-inf")])
    cases[torch.int32] = torch.arange(-50, 50, dtype=torch.int32)
    for dtype, t in cases.items():
        here = probe._plain(t.reshape(-1), sumsq_here=True)[0]
        assert here.shape == (9,) and here[8].item() == _sumsq(t) == float(probe._sumsq_device(t)), dtype
        assert probe._plain(t.reshape(-1))[0][8].item() == 0.0, dtype
