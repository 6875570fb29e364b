"""The fused probe kernels (Triton): one read of every byte per dtype group.

Imported only by ``workbench.rank.probe`` when it probes CUDA tensors. The fingerprint
here must stay bit-identical to ``fingerprint._fingerprint_lanes`` (the plain torch path).

One program summarises BLOCK * ITERS 32-bit words of one tensor. A whole block with only
finite values (the common case) takes the fast loop: plain min/max/sum and the hash, no
masks. A tail block, or a block whose lane sums came out non-finite (a NaN or Inf was
read, or the sum overflowed), is re-read by the careful loop, which masks, counts NaN,
Inf and poison, and keeps min/max/sum to finite values.
"""

import triton
import triton.language as tl


@triton.jit
def _unpack(w, KIND: tl.constexpr):
    """The two 16-bit values of a word as fp32 (KIND 0: bf16, 1: fp16), or the fp32 word twice."""
    if KIND == 0:
        x0 = (w << 16).to(tl.float32, bitcast=True)
        x1 = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif KIND == 1:
        x0 = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x1 = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x0 = w.to(tl.float32, bitcast=True)
        x1 = x0
    return x0, x1


@triton.jit
def _hash(w, idx):
    a = (w ^ (idx * 0x9E3779B1)) * 0x85EBCA77
    a = a ^ (a >> 15)
    c = (w + idx * 0xC2B2AE3D) * 0x27D4EB2F
    c = c ^ (c >> 13)
    return a, c


@triton.jit
def _careful(x, ok, lo, hi, s, nn_, ni):
    good = ok & (tl.abs(x) < float("inf"))
    lo = tl.minimum(lo, tl.where(good, x, float("inf")))
    hi = tl.maximum(hi, tl.where(good, x, -float("inf")))
    s += tl.where(good, x, 0.0)
    nn_ += (ok & (x != x)).to(tl.int32)
    ni += (ok & (tl.abs(x) == float("inf"))).to(tl.int32)
    return lo, hi, s, nn_, ni


@triton.jit
def probe_kernel(ptrs, nwords, first, blk_t, part_f, part_i, POISON: tl.constexpr, KIND: tl.constexpr,
                 BLOCK: tl.constexpr, ITERS: tl.constexpr, HINT: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(blk_t + pid)
    n = tl.load(nwords + t)
    start = (pid - tl.load(first + t)).to(tl.int64) * (BLOCK * ITERS)
    base = tl.load(ptrs + t).to(tl.pointer_type(tl.uint32))
    if HINT:
        base = tl.multiple_of(base, 16)
    lane = tl.arange(0, BLOCK)
    idx0 = start.to(tl.uint32) + 1 + lane.to(tl.uint32)
    blk = base + start  # this program's first word: in-block offsets stay 32-bit
    if HINT:
        blk = tl.multiple_of(blk, 16)
    k1 = idx0 * 0x9E3779B1
    k3 = idx0 * 0xC2B2AE3D
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    hi = tl.full([BLOCK], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    h1 = tl.zeros([BLOCK], tl.uint32)
    h2 = tl.zeros([BLOCK], tl.uint32)
    nn_ = tl.zeros([BLOCK], tl.int32)
    ni = tl.zeros([BLOCK], tl.int32)
    npz = tl.zeros([BLOCK], tl.int32)
    full = start + BLOCK * ITERS <= n
    if full:
        for it in tl.static_range(ITERS):
            w = tl.load(blk + (it * BLOCK + lane))
            a = (w ^ (k1 + ((it * BLOCK * 0x9E3779B1) & 0xFFFFFFFF))) * 0x85EBCA77
            a = a ^ (a >> 15)
            c = (w + (k3 + ((it * BLOCK * 0xC2B2AE3D) & 0xFFFFFFFF))) * 0x27D4EB2F
            c = c ^ (c >> 13)
            h1 += a
            h2 += c
            x0, x1 = _unpack(w, KIND)
            if KIND == 2:
                lo = tl.minimum(lo, x0)
                hi = tl.maximum(hi, x0)
                s += x0
            else:
                lo = tl.minimum(lo, tl.minimum(x0, x1))
                hi = tl.maximum(hi, tl.maximum(x0, x1))
                s += x0 + x1
    total = tl.sum(s, axis=0)
    if (start + BLOCK * ITERS > n) | (tl.abs(total) >= float("inf")) | (total != total):
        lo = tl.full([BLOCK], float("inf"), tl.float32)
        hi = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        h1 = tl.zeros([BLOCK], tl.uint32)
        h2 = tl.zeros([BLOCK], tl.uint32)
        for it in tl.static_range(ITERS):
            offs = start + it * BLOCK + lane
            ok = offs < n
            w = tl.load(base + offs, mask=ok, other=0)
            a, c = _hash(w, idx0 + it * BLOCK)
            h1 += tl.where(ok, a, 0)
            h2 += tl.where(ok, c, 0)
            x0, x1 = _unpack(w, KIND)
            lo, hi, s, nn_, ni = _careful(x0, ok, lo, hi, s, nn_, ni)
            if KIND == 2:
                npz += (ok & (w == POISON)).to(tl.int32)
            else:
                lo, hi, s, nn_, ni = _careful(x1, ok, lo, hi, s, nn_, ni)
                npz += (ok & ((w & 0xFFFF) == POISON)).to(tl.int32) + (ok & ((w >> 16) == POISON)).to(tl.int32)
        total = tl.sum(s, axis=0)
    tl.store(part_f + pid * 3 + 0, tl.min(lo, axis=0))
    tl.store(part_f + pid * 3 + 1, tl.max(hi, axis=0))
    tl.store(part_f + pid * 3 + 2, total)
    tl.store(part_i + pid * 5 + 0, tl.sum(nn_, axis=0).to(tl.int64))
    tl.store(part_i + pid * 5 + 1, tl.sum(ni, axis=0).to(tl.int64))
    tl.store(part_i + pid * 5 + 2, tl.sum(npz, axis=0).to(tl.int64))
    tl.store(part_i + pid * 5 + 3, tl.sum(h1, axis=0).to(tl.int64))
    tl.store(part_i + pid * 5 + 4, tl.sum(h2, axis=0).to(tl.int64))


@triton.jit
def raw_kernel(ptrs, nwords, out, WORDS: tl.constexpr):
    t = tl.program_id(0)
    n = tl.load(nwords + t)
    base = tl.load(ptrs + t).to(tl.pointer_type(tl.uint32))
    offs = tl.arange(0, WORDS)
    w = tl.load(base + offs, mask=offs < n, other=0)
    tl.store(out + t * WORDS + offs, w.to(tl.int64))
