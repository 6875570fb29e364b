"""What one rank sends and receives in one collective, as that op defines it.

Ranks of one collective need not pass alike arguments: the source of a broadcast, scatter
or gather holds what its peers receive into, a scatter's non-source ranks pass no scatter
list, an all_to_all moves a different amount between each pair. Comparing argument lists
across ranks (what the ledger once did) then reads a correct call as a mismatch: DTensor's
``distribute_tensor`` scatters from rank 0 while the other ranks pass nothing.

So each call records, per peer, what travels: ``send[p]`` is what this rank sends to peer
``p``, ``recv[p]`` what it receives from ``p``, both ``"dtype:numel"`` per tensor joined by
``,``; ``p`` is the peer's index in the group, ``"*"`` every other member. Pairing then
checks, for two ranks a and b, that a's ``send[b]`` is b's ``recv[a]`` and back: the dtype and
the element count of what crosses between each pair, nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

ALL = "*"
Traffic = tuple[list[torch.Tensor], dict[str, str], dict[str, str]]  # (payload, send, recv)


def sig(ts: list[torch.Tensor], numel: int | None = None) -> str:
    """``float32:64,bfloat16:8``: each tensor's dtype and element count (``numel`` overrides the count)."""
    return ",".join(f"{str(t.dtype).replace('torch.', '')}:{t.numel() if numel is None else numel}" for t in ts)


def _chunk(ts: list[torch.Tensor], n: int) -> str:
    """One rank's share of each tensor split evenly n ways (all_gather's output, reduce_scatter's input)."""
    return ",".join(f"{str(t.dtype).replace('torch.', '')}:{t.numel() // max(n, 1)}" for t in ts)


def _arg(b: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` bound to something (never ``x or y`` on a tensor: its truth is ambiguous)."""
    return next((b[k] for k in names if b.get(k) is not None), None)


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _column(lists: Any, p: int) -> list[torch.Tensor]:
    """The p-th tensor of each list (``Tensor[][]`` arguments: one list per local tensor, one entry per rank)."""
    return [lst[p] for lst in lists or [] if isinstance(lst, (list, tuple)) and p < len(lst)]


def _splits(t: torch.Tensor, sizes: list[int] | None, n: int) -> list[int]:
    """Element counts an all_to_all_single moves to/from each peer (equal parts when no splits are given)."""
    row = t.numel() // t.shape[0] if t.dim() and t.shape[0] else t.numel()
    if sizes:
        return [int(s) * row for s in sizes]
    return [t.numel() // max(n, 1)] * n


def _rooted(me: int, root: int, to_root: bool, mine: str, peers: dict[str, str]) -> tuple[dict, dict]:
    """A rooted op: non-roots send to (or receive from) the root; the root receives from (sends to) ``peers``."""
    if me == root:
        return ({}, peers) if to_root else (peers, {})
    return ({str(root): mine}, {}) if to_root else ({}, {str(root): mine})


def traffic(raw: str, b: dict[str, Any], me: int, n: int) -> Traffic:
    """(this rank's payload, send, recv) of c10d or functional op ``raw`` with bound arguments ``b``.

    ``me``: this rank's index in the group; ``n``: the group's size.
    """
    peers = [p for p in range(n) if p != me]
    if raw in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
               "all_reduce_coalesced_"):
        ts = _tensors(_arg(b, "tensors", "input", "inputs"))
        return ts, {ALL: sig(ts)}, {ALL: sig(ts)}
    if raw in ("broadcast_", "broadcast"):
        ts = _tensors(_arg(b, "tensors", "input"))
        root = int(_arg(b, "root_rank", "src") or 0)
        send, recv = _rooted(me, root, False, sig(ts), {ALL: sig(ts)})
        return ts, send, recv
    if raw == "reduce_":
        ts = _tensors(b.get("tensors"))
        send, recv = _rooted(me, int(b.get("root_rank") or 0), True, sig(ts), {ALL: sig(ts)})
        return ts, send, recv
    if raw == "scatter_":
        outs, root = _tensors(b.get("output_tensors")), int(b.get("root_rank") or 0)
        ins = b.get("input_tensors") or []
        send, recv = _rooted(me, root, False, sig(outs), {str(p): sig(_column(ins, p)) for p in peers})
        return (_tensors(ins) if me == root else outs), send, recv
    if raw == "gather_":
        ins, root = _tensors(b.get("input_tensors")), int(b.get("root_rank") or 0)
        outs = b.get("output_tensors") or []
        send, recv = _rooted(me, root, True, sig(ins), {str(p): sig(_column(outs, p)) for p in peers})
        return ins, send, recv
    if raw in ("allgather_", "allgather_coalesced_"):
        ins = _tensors(_arg(b, "input_tensors", "input_list"))
        outs = _arg(b, "output_tensors", "output_lists") or []
        if raw == "allgather_coalesced_":  # output_lists[rank] holds that rank's tensors
            recv = {str(p): sig(_tensors(outs[p]) if p < len(outs) else []) for p in peers}
        else:
            recv = {str(p): sig(_column(outs, p)) for p in peers}
        return ins, {ALL: sig(ins)}, recv
    if raw in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        ins = _tensors(_arg(b, "input_tensor", "inputs"))
        outs = _tensors(_arg(b, "output_tensor", "outputs"))
        return ins, {ALL: sig(ins)}, {ALL: _chunk(outs, n)}
    if raw in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"):
        ins = _tensors(_arg(b, "input", "inputs"))
        out = b.get("out")
        return ins, {ALL: sig(ins)}, {ALL: _chunk([out], n) if isinstance(out, torch.Tensor) else sig(ins)}
    if raw in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        ins = _tensors(_arg(b, "input_tensor", "inputs"))
        outs = _tensors(_arg(b, "output_tensor", "outputs"))
        return ins, {ALL: _chunk(ins, n)}, {ALL: sig(outs)}
    if raw in ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"):
        ins = _tensors(_arg(b, "input", "inputs"))
        return ins, {ALL: _chunk(ins, n)}, {ALL: _chunk(ins, n)}
    if raw == "reduce_scatter_":
        ins, outs = b.get("input_tensors") or [], _tensors(b.get("output_tensors"))
        return _tensors(ins), {str(p): sig(_column(ins, p)) for p in peers}, {ALL: sig(outs)}
    if raw == "alltoall_":
        ins, outs = _tensors(b.get("input_tensors")), _tensors(b.get("output_tensors"))
        return (ins, {str(p): sig(ins[p:p + 1]) for p in peers}, {str(p): sig(outs[p:p + 1]) for p in peers})
    if raw in ("alltoall_base_", "all_to_all_single"):
        inp, out = b.get("input"), b.get("output")
        if not isinstance(inp, torch.Tensor):
            return [], {}, {}
        sent = _splits(inp, b.get("input_split_sizes"), n)
        got = _splits(out, b.get("output_split_sizes"), n) if isinstance(out, torch.Tensor) else \
            _splits(inp, b.get("output_split_sizes"), n)
        dt = str(inp.dtype).replace("torch.", "")
        return ([inp], {str(p): f"{dt}:{sent[p]}" for p in peers if p < len(sent)},
                {str(p): f"{dt}:{got[p]}" for p in peers if p < len(got)})
    if raw in ("send", "isend"):
        ts = _tensors(_arg(b, "tensors", "tensor"))
        return ts, {str(int(b["dst"])): sig(ts)}, {}
    if raw in ("recv_", "irecv"):
        ts = _tensors(_arg(b, "tensors", "tensor"))
        return ts, {}, {str(int(b["src"])): sig(ts)}
    if raw == "recv_any_source_":
        ts = _tensors(b.get("tensors"))
        return ts, {}, {"?": sig(ts)}
    return [], {}, {}  # barrier, monitored_barrier, batch_p2p_ops (split into its sends and receives)
