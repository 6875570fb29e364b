"""Does rank 1's stream finish after the headline incident's mispaired FSDP1 broadcast?

The headline scenario (fsdp1-rotary-meta-init) outside the workbench: no engines, no probe,
no ledger (unless ``--ledger``), exactly the scenario's load / cast / wrap steps under
torchrun. After the wrap each rank records a CUDA event on its current stream and polls
it (never a blocking host sync) for ``--wait`` seconds: "done" means any host read of the
rank's tensors would return, "stuck" means it would block (the NCCL broadcast kernel
queued before it still waits for bytes). With ``--flush``, when rank 1 is stuck, rank 0
issues one more broadcast of the size rank 1 posted and rank 1 polls again: if it then
finishes, its kernel was waiting for bytes its peer had not sent.

When rank 1 finishes, it reports how many of the broadcast tensors hold the checkpoint's
values, rank 1's inv_freq, and the shift of its received stream against rank 0's sent
stream (passed through the store), then both ranks run one forward against a
single-GPU reference (``--forward``).

    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        scripts/nccl_headline_probe.py --shape wb --sharding NO_SHARD --flush --forward

``--shape wb`` is the workbench's QWEN3_SHAPE; ``--shape ref`` is the shape of
/work/shared/reference/headline_gpu.py ("tiny"); ``--set key=value`` overrides either.
``--cpu`` is a gloo dry run of the script's own plumbing (use ``--mode fixed`` there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REF_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["wb", "ref"], default="wb")
    ap.add_argument("--set", nargs="*", default=[], help="shape overrides key=int")
    ap.add_argument("--sharding", default="NO_SHARD")
    ap.add_argument("--mode", choices=["bug", "fixed"], default="bug", help="fixed: keep rank 1's inv_freq fp32")
    ap.add_argument("--wait", type=float, default=6.0)
    ap.add_argument("--flush", action="store_true")
    ap.add_argument("--forward", action="store_true")
    ap.add_argument("--no-poison", action="store_true")
    ap.add_argument("--ledger", action="store_true", help="wrap the FSDP call in the workbench ledger")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--json", default=None, help="append one JSON line per rank here")
    a = ap.parse_args()

    from workbench.lab.fsdp_cpu import allow_cpu_sync_module_states
    from workbench.lab.models import QWEN3_SHAPE, build_on_meta, load_pretrained, qwen3_config, save_checkpoint
    from workbench.rank import poison

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t0 = time.time()
    res: dict = {"rank": rank, "shape": a.shape, "set": a.set, "sharding": a.sharding, "mode": a.mode,
                 "poison": not a.no_poison, "ledger": a.ledger}

    def log(*msg) -> None:
        print(f"[{a.shape}/{a.sharding}/{a.mode} r{rank} {time.time() - t0:6.2f}s]", *msg, flush=True)

    if a.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    else:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=dev)
    store = dist.distributed_c10d._get_default_store()
    shape = dict(QWEN3_SHAPE if a.shape == "wb" else REF_SHAPE)
    for kv in a.set:
        k, v = kv.split("=")
        shape[k] = int(v)
    config = qwen3_config(**shape)
    ckpt = save_checkpoint(config, os.path.join(tempfile.mkdtemp(prefix=f"nhp-r{rank}-"), "ckpt"), 0)
    poison.set_poison(not a.no_poison)

    captured: list = []
    names: dict[int, str] = {}  # data_ptr at broadcast time -> name (FSDP flattens afterwards)
    holder: dict = {}
    original_bc = dist._broadcast_coalesced

    def capturing_bc(pg, tensors, bucket, src=0):
        for n, p in holder["model"].named_parameters():
            names[p.data_ptr()] = n
        for n, b in holder["model"].named_buffers():
            names.setdefault(b.data_ptr(), n)
        captured.append(list(tensors))
        return original_bc(pg, tensors, bucket, src)

    dist._broadcast_coalesced = capturing_bc

    if rank == 0:
        model = load_pretrained(ckpt, torch.bfloat16, dev)
    else:
        model = build_on_meta(config)
        model.to(torch.bfloat16)
        if a.mode == "fixed":
            rot = model.model.rotary_emb
            rot.inv_freq, rot.original_inv_freq = rot.inv_freq.float(), rot.original_inv_freq.float()

    holder["model"] = model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    def param_init_fn(module):
        module.to_empty(device=dev, recurse=False)

    import contextlib

    rec = contextlib.nullcontext()
    if a.ledger:
        from workbench.rank import ledger

        rec = ledger.recording(ledger.Ledger(tempfile.mkdtemp(prefix="nhp-ledger-"), rank, "probe"), "wrap_fsdp1")
    t = time.time()
    wrap_error = None
    try:
        with rec, allow_cpu_sync_module_states(dev.type):
            wrapped = FSDP(model, param_init_fn=param_init_fn, sync_module_states=True, device_id=dev,
                           sharding_strategy=ShardingStrategy[a.sharding], use_orig_params=True)
    except Exception as exc:
        wrap_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        wrapped = None
    res["wrap_host_s"] = round(time.time() - t, 4)
    res["wrap_error"] = wrap_error
    res["buckets"] = _buckets(captured[0]) if captured else None
    log("wrap returned to the host in", res["wrap_host_s"], "s; error:", wrap_error, "buckets:", res["buckets"])

    # Would a host read block? Poll an event behind everything queued on this rank's stream.
    res["stream_done_s"] = _poll(dev, a.wait)
    log("stream after the wrap:", f"done in {res['stream_done_s']:.3f}s" if res["stream_done_s"] is not None
        else f"STUCK (not done after {a.wait}s)")
    if rank == 0 and captured and res["stream_done_s"] is not None:
        store.set("sent", _stream(captured[0], fp32_first=True).numpy().tobytes())
    store.set(f"done{rank}", "1" if res["stream_done_s"] is not None else "0")
    if rank == 1 and captured:
        store.set("r1_numel", str(sum(t.numel() for t in captured[0])))

    other = 1 - rank
    store.wait([f"done{other}"], datetime.timedelta(seconds=a.wait + 60))
    other_done = store.get(f"done{other}") == b"1"
    res["flushed"] = False
    if a.flush and world == 2:
        r1_stuck = (store.get("done1") == b"0")
        if r1_stuck:
            res["flushed"] = True
            if rank == 0:
                n = int(store.get("r1_numel"))
                extra = torch.full((n,), 7.0, dtype=torch.bfloat16, device=dev)
                dist.broadcast(extra, src=0)  # rank 1 posts nothing: these bytes can only feed its stuck kernel
                log(f"flush: rank 0 broadcast {n} bf16 ({2 * n} B)")
            else:
                res["stream_done_after_flush_s"] = _poll(dev, a.wait)
                log("after rank 0's extra broadcast rank 1's stream is",
                    f"done in {res['stream_done_after_flush_s']:.3f}s" if res["stream_done_after_flush_s"]
                    is not None else "STILL STUCK")

    if rank == 1 and captured and (res["stream_done_s"] is not None or res.get("stream_done_after_flush_s")
                                   is not None):
        res.update(_diag(model, captured[0], names, ckpt, store))
        log("received:", {k: res[k] for k in ("tensors_exact", "tensors_total", "inv_freq_head", "shift_match")})
    both = res["stream_done_s"] is not None and other_done and not res["flushed"]
    if a.forward and both and wrapped is not None:
        from workbench.lab.models import token_batch

        ids = token_batch(shape["vocab_size"], 16, 0, dev)
        ref = load_pretrained(ckpt, torch.bfloat16, dev)
        with torch.no_grad():
            lg = wrapped(input_ids=ids).logits.float()
            rl = ref(input_ids=ids).logits.float()
        d = _poll(dev, a.wait)
        if d is not None:
            res["logits_max_abs_diff_vs_single_gpu"] = float((lg - rl).abs().nan_to_num(nan=float("inf")).max())
            res["logits_nan"] = int(torch.isnan(lg).sum())
            log("forward: max|logits - single-GPU reference| =", res["logits_max_abs_diff_vs_single_gpu"],
                "NaN:", res["logits_nan"])
        else:
            res["forward_stuck"] = True
            log("forward: STUCK")
    line = json.dumps(res, default=str)
    print("RESULT", line, flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(line + "\n")
    store.add("fin", 1)
    deadline = time.time() + 20
    while int(store.add("fin", 0)) < world and time.time() < deadline:
        time.sleep(0.05)
    os._exit(0)  # never destroy a communicator that may hold a stuck kernel


def _poll(dev: torch.device, limit: float) -> float | None:
    if dev.type != "cuda":
        return 0.0
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    t = time.perf_counter()
    while not ev.query():
        if time.perf_counter() - t > limit:
            return None
        time.sleep(0.002)
    return round(time.perf_counter() - t, 4)


def _buckets(tensors) -> list:
    out: dict[str, list[int]] = {}
    for t in tensors:
        s = out.setdefault(str(t.dtype).replace("torch.", ""), [0, 0])
        s[0] += 1
        s[1] += t.numel() * t.element_size()
    return [[k, *v] for k, v in out.items()]


def _stream(tensors, fp32_first: bool) -> torch.Tensor:
    """The bytes a rank's _broadcast_coalesced moves, as int16 words, dtype buckets in order."""
    fp32 = [t.reshape(-1).view(torch.int16) for t in tensors if t.dtype == torch.float32]
    bf16 = [t.reshape(-1).view(torch.int16) for t in tensors if t.dtype != torch.float32]
    return torch.cat((fp32 + bf16) if fp32_first else (bf16 + fp32)).cpu()


def _named(tensors, names: dict[int, str], suffix: str) -> torch.Tensor:
    for t in tensors:
        if names.get(t.data_ptr(), "").endswith(suffix):
            return t.detach().reshape(-1)
    return torch.zeros(0)


def _diag(model, tensors, names: dict[int, str], ckpt: str, store) -> dict:
    import numpy as np
    from safetensors.torch import load_file

    sd = load_file(os.path.join(ckpt, "model.safetensors"))
    rot = model.model.rotary_emb
    ref_inv, _ = rot.compute_default_rope_parameters(rot.config)
    exact, wrong = 0, []
    for t in tensors:
        n = names.get(t.data_ptr(), "?")
        exp = ref_inv if "inv_freq" in n else sd.get(n)
        ok = exp is not None and torch.equal(t.detach().cpu(), exp.to(t.dtype))
        exact += ok
        if not ok:
            wrong.append(n)
    out = {"tensors_exact": exact, "tensors_total": len(tensors), "tensors_wrong_first": wrong[:4],
           "inv_freq_head": [float(v) for v in _named(tensors, names, "rotary_emb.inv_freq").float()[:6].cpu()]}
    try:
        if not store.check(["sent"]):
            raise RuntimeError("rank 0 published no sent stream")
        sent = np.frombuffer(store.get("sent"), dtype=np.int16)
        recv = _stream(tensors, fp32_first=True).numpy()
        match = {}
        for sh in (-128, -64, 0, 64, 128):
            a0, b0 = max(0, -sh), max(0, sh)
            n = min(recv.size - a0, sent.size - b0)
            match[sh] = round(float((recv[a0:a0 + n] == sent[b0:b0 + n]).mean()), 4)
        out["shift_match"] = match
        out["recv_words"], out["sent_words"] = int(recv.size), int(sent.size)
    except Exception as exc:
        out["shift_match"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    main()
