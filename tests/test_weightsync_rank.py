"""The weight-sync rank pieces on their own (no engines): export, pack, handles, receive.

A real tiny DeepseekV3 throughout; the cross-process handle test maps the packed buffer
from a second Python process, so the shared-memory path is the real one.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.errors import WorkbenchError
from workbench.lab.weightsync import ipc, receive
from workbench.lab.weightsync import model as wm
from workbench.lab.weightsync import pack as wp

ROOT = Path(__file__).resolve().parents[1]
BIAS = "model.layers.0.mlp.gate.e_score_correction_bias"
EXP = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def trainer():
    return wm.build_model(wm.tiny_config(), seed=0)


def packs_of(model, rank, keep=wp.ROUTING_SUFFIXES, dtype=torch.bfloat16):
    return wp.pack_for_sync(wm.export_hf_weights(model, rank, 2), dtype, keep)


def test_expert_parallel_export_differs_per_rank_with_equal_sizes(trainer):
    r0 = list(wm.export_hf_weights(trainer, 0, 2))
    r1 = list(wm.export_hf_weights(trainer, 1, 2))
    assert [n for n, _ in r0][:2] == [f"{EXP}.0.gate_up_proj", f"{EXP}.0.down_proj"]
    assert [n for n, _ in r1][:2] == [f"{EXP}.4.gate_up_proj", f"{EXP}.4.down_proj"]
    assert sum(a != b for (a, _), (b, _) in zip(r0, r1)) == 8  # 4 experts x 2 weights; the dense tail agrees
    assert [t.shape for _, t in r0] == [t.shape for _, t in r1]
    rep = [[n for n, _ in wm.export_hf_weights(trainer, r, 2, layout="replicated")] for r in (0, 1)]
    assert rep[0] == rep[1] and len(rep[0]) == len(r0) + 8
    with pytest.raises(WorkbenchError, match="unknown export layout 'pp'"):
        list(wm.export_hf_weights(trainer, 0, 2, layout="pp"))


def test_pack_then_slice_gives_every_tensor_back_bit_for_bit(trainer):
    sent = dict(wp.cast_for_sync(wm.export_hf_weights(trainer, 1, 2), torch.bfloat16, wp.ROUTING_SUFFIXES))
    packs = packs_of(trainer, 1)
    assert [p.data.dtype for p in packs] == [torch.bfloat16, torch.float32]  # the bias keeps fp32: 2 buffers
    assert packs[1].names == [BIAS] and sum(p.data.numel() for p in packs) == sum(t.numel() for t in sent.values())
    got = {n: t for p in packs for n, t in receive.slice_packed(p.data, p.metadata())}
    assert list(got) == [n for p in packs for n in p.names] and set(got) == set(sent)
    assert all(torch.equal(got[n], sent[n]) and got[n].dtype == sent[n].dtype for n in sent)


def test_a_mixed_bucket_cannot_share_one_buffer(trainer):
    named = list(wp.cast_for_sync(wm.export_hf_weights(trainer, 0, 2), torch.bfloat16, wp.ROUTING_SUFFIXES))
    with pytest.raises(WorkbenchError, match=f"tensor '{BIAS}' is float32 but the buffer is bfloat16"):
        wp.pack(named)
    small = wp.pack_for_sync(wm.export_hf_weights(trainer, 0, 2), torch.bfloat16, (), threshold_bytes=4096)
    assert len(small) > 2 and all(p.nbytes <= 4096 or len(p.names) == 1 for p in small)


def test_bf16_cast_collapses_the_router_bias(trainer):
    bias = dict(wm.router_biases(trainer))[BIAS]
    assert bias.dtype == torch.float32 and wm.distinct_values(bias) == 8 and 40 < float(bias.mean()) < 42
    assert wm.distinct_values(bias.to(torch.bfloat16)) <= 2  # spacing 0.25 at 32..64 vs per-expert std 7e-4


def test_handle_rebuilds_in_another_process_on_the_same_memory():
    t = torch.arange(10, dtype=torch.bfloat16)
    h = ipc.make_handle(t, "w")
    code = ("import sys, pickle; from workbench.lab.weightsync import ipc; "
            "t = ipc.rebuild(pickle.loads(sys.stdin.buffer.read())); print(t.tolist()); t[0] = 42")
    p = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(h), capture_output=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert p.returncode == 0, p.stderr.decode()[-400:]
    assert p.stdout.decode().strip() == str([float(i) for i in range(10)])
    assert t[0].item() == 42  # the child wrote into our buffer: shared memory, not a copy


def test_rank0_metadata_on_rank1_buffer_loads_bytes_under_wrong_names(trainer):
    """The bug in miniature: no error, and expert 0's name holds rank 1's expert 4."""
    p0, p1 = packs_of(trainer, 0)[0], packs_of(trainer, 1)[0]
    got = dict(receive.slice_packed(p1.data, p0.metadata()))
    sent1 = dict(wp.cast_for_sync(wm.export_hf_weights(trainer, 1, 2), torch.bfloat16))
    assert torch.equal(got[f"{EXP}.0.gate_up_proj"], sent1[f"{EXP}.4.gate_up_proj"])
    assert torch.equal(got["model.embed_tokens.weight"], sent1["model.embed_tokens.weight"])


def test_bad_inputs_give_one_line_naming_the_tensor(trainer):
    p = packs_of(trainer, 0)[0]
    meta = p.metadata()
    short = {**meta, "sizes": [*meta["sizes"][:-1], meta["sizes"][-1] - 1],
             "shapes": [*meta["shapes"][:-1], [meta["sizes"][-1] - 1]]}
    with pytest.raises(receive.ReceiveError, match=r"sizes add up to \d+ elements but the buffer holds \d+ "
                                                    r"\(metadata ends with tensor 'lm_head.weight'\)"):
        list(receive.slice_packed(p.data, short))
    wrong = {**meta, "sizes": [meta["sizes"][0] + 1, *meta["sizes"][1:]]}
    with pytest.raises(receive.ReceiveError, match=re.escape(f"tensor '{EXP}.0.gate_up_proj': metadata size")):
        list(receive.slice_packed(p.data, wrong))
    h = ipc.make_handle(p.data, p.names[0])
    renamed = {**meta, "names": [f"{EXP}.9.gate_up_proj", *meta["names"][1:]]}
    req = ipc.request_per_rank([{"cpu:0": {"handle": h, "metadata": renamed}}])
    inference = wm.build_model(wm.tiny_config(), seed=1)
    with pytest.raises(receive.ReceiveError, match=re.escape(f"has no tensor '{EXP}.9.gate_up_proj'")):
        receive.update_weights_ipc(req, "cpu:0", lambda n, t: wm.load_hf_weight(inference, n, t))
    with pytest.raises(ipc.HandleError, match="no handle for device 'cpu:1'"):
        req.for_device("cpu:1")
    bad = ipc.Handle("cpu", b"not a handle", p.data.numel(), "bfloat16", p.names[0])
    with pytest.raises(ipc.HandleError, match=re.escape(
            f"cannot rebuild the IPC handle of the cpu buffer starting with tensor '{EXP}.0.gate_up_proj'")):
        ipc.rebuild(bad)
    for exc in (receive.ReceiveError, ipc.HandleError):
        assert issubclass(exc, WorkbenchError)
