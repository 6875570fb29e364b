"""The fused probe kernel (Triton): one launch reads every byte of every tensor once.

Imported only by ``workbench.rank.probe`` when it probes CUDA tensors. The fingerprint
here must stay bit-identical to ``fingerprint._fingerprint_lanes`` (the plain torch path).

One launch covers every tensor of every fused dtype: a packed descriptor table (pointer,
32-bit words, first program, dtype kind) and a program -> tensor map say which
BLOCK * ITERS words each program summarises. A whole block with only finite values (the
common case) takes the fast loop: plain min/max/sum and the hash, no masks. A tail block,
or a block whose lane sums came out non-finite (a NaN or Inf was read, or the sum
overflowed), is re-read by the careful loop, which masks, counts NaN, Inf and poison, and
keeps min/max/sum to finite values. Each program folds its block into its tensor's
accumulator row with atomics (integer sums, order-preserving keys for min/max, a float64
sum and sum of squares), so the per-tensor statistics need no second pass; the tensor's first program also
copies its first 256 bytes and the bytes at the window offsets.
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
def _careful(x, ok, lo, hi, s, q, nn_, ni):
    good = ok & (tl.abs(x) < float("inf"))
    lo = tl.minimum(lo, tl.where(good, x, float("inf")))
    hi = tl.maximum(hi, tl.where(good, x, -float("inf")))
    xg = tl.where(good, x, 0.0)
    s += xg
    q += xg * xg
    nn_ += (ok & (x != x)).to(tl.int32)
    ni += (ok & (tl.abs(x) == float("inf"))).to(tl.int32)
    return lo, hi, s, q, nn_, ni


@triton.jit
def _key(f):
    """A float32 as a uint32 that orders like the float (NaN aside): atomic_max can fold it."""
    b = f.to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000)


@triton.jit
def _block(base, start, n, acc_t, accf_t, KIND: tl.constexpr, POISON: tl.constexpr, BLOCK: tl.constexpr,
           ITERS: tl.constexpr, HINT: tl.constexpr):
    """One program's block of one tensor: the statistics, folded into the tensor's accumulator row."""
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
    q = tl.zeros([BLOCK], tl.float32)
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
                q += x0 * x0
            else:
                lo = tl.minimum(lo, tl.minimum(x0, x1))
                hi = tl.maximum(hi, tl.maximum(x0, x1))
                s += x0 + x1
                q += x0 * x0 + x1 * x1
    total = tl.sum(s, axis=0)
    if (start + BLOCK * ITERS > n) | (tl.abs(total) >= float("inf")) | (total != total):
        lo = tl.full([BLOCK], float("inf"), tl.float32)
        hi = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        q = tl.zeros([BLOCK], tl.float32)
        h1 = tl.zeros([BLOCK], tl.uint32)
        h2 = tl.zeros([BLOCK], tl.uint32)
        for it in range(ITERS):  # rare (tails, non-finite blocks): a loop, not unrolled, keeps registers free
            offs = start + it * BLOCK + lane
            ok = offs < n
            w = tl.load(base + offs, mask=ok, other=0)
            a, c = _hash(w, idx0 + it * BLOCK)
            h1 += tl.where(ok, a, 0)
            h2 += tl.where(ok, c, 0)
            x0, x1 = _unpack(w, KIND)
            lo, hi, s, q, nn_, ni = _careful(x0, ok, lo, hi, s, q, nn_, ni)
            if KIND == 2:
                npz += (ok & (w == POISON)).to(tl.int32)
            else:
                lo, hi, s, q, nn_, ni = _careful(x1, ok, lo, hi, s, q, nn_, ni)
                npz += (ok & ((w & 0xFFFF) == POISON)).to(tl.int32) + (ok & ((w >> 16) == POISON)).to(tl.int32)
        total = tl.sum(s, axis=0)
    tl.atomic_add(acc_t + 0, tl.sum(nn_, axis=0).to(tl.int64), sem="relaxed")
    tl.atomic_add(acc_t + 1, tl.sum(ni, axis=0).to(tl.int64), sem="relaxed")
    tl.atomic_add(acc_t + 2, tl.sum(npz, axis=0).to(tl.int64), sem="relaxed")
    tl.atomic_add(acc_t + 3, tl.sum(h1, axis=0).to(tl.int64), sem="relaxed")
    tl.atomic_add(acc_t + 4, tl.sum(h2, axis=0).to(tl.int64), sem="relaxed")
    tl.atomic_max(acc_t + 5, (0xFFFFFFFF - _key(tl.min(lo, axis=0))).to(tl.int64), sem="relaxed")
    tl.atomic_max(acc_t + 6, _key(tl.max(hi, axis=0)).to(tl.int64), sem="relaxed")
    tl.atomic_add(accf_t + 7, total.to(tl.float64), sem="relaxed")
    tl.atomic_add(accf_t + 8, tl.sum(q, axis=0).to(tl.float64), sem="relaxed")


@triton.jit
def probe_all_kernel(desc, blk_t, acc, accf, words, hexs, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                     HINT: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
    """Every tensor in one launch. ``desc`` [T, 4] int64: pointer, 32-bit words, first program, kind
    (0 bf16, 1 fp16, 2 fp32); ``blk_t`` [programs] int32: each program's tensor; ``acc``/``accf`` [T, 9]
    (one zeroed buffer, int64 and float64 views): NaN, Inf, poison, lane 1, lane 2, 2**32-1 - min key,
    max key, sum, sum of squares; ``words`` [T, 96] int32: the first 64 words, then 8 words at each window offset W0-W3;
    ``hexs`` [T, 768] uint8: the same bytes as lowercase hex (the rows' ``raw`` and ``windows``)."""
    pid = tl.program_id(0)
    t = tl.load(blk_t + pid)
    row = desc + t * 4
    n = tl.load(row + 1)
    local = pid - tl.load(row + 2)
    kind = tl.load(row + 3)
    base = tl.load(row).to(tl.pointer_type(tl.uint32))
    if HINT:
        base = tl.multiple_of(base, 16)
    start = local.to(tl.int64) * (BLOCK * ITERS)
    acc_t = acc + t * 9
    accf_t = accf + t * 9
    if kind == 0:
        _block(base, start, n, acc_t, accf_t, 0, 0x7FA5, BLOCK, ITERS, HINT)
    elif kind == 1:
        _block(base, start, n, acc_t, accf_t, 1, 0x7D5A, BLOCK, ITERS, HINT)
    else:
        _block(base, start, n, acc_t, accf_t, 2, 0x7FA5A5A5, BLOCK, ITERS, HINT)
    if local == 0:
        offs = tl.arange(0, 128)
        k = (offs - 64) // 8
        win = tl.where(k == 0, W0, tl.where(k == 1, W1, tl.where(k == 2, W2, W3))) + (offs - 64) % 8
        src = tl.where(offs < 64, offs, win)
        keep = offs < 96
        w = tl.load(base + src, mask=keep & (src < n), other=0)
        tl.store(words + t * 96 + offs, w.to(tl.int32, bitcast=True), mask=keep)
        j = tl.arange(0, 8)
        shift = ((j // 2) * 8 + (1 - j % 2) * 4).to(tl.uint32)  # byte j // 2, high nibble first
        nib = (w[:, None] >> shift[None, :]) & 0xF
        ch = nib + 48 + (nib > 9).to(tl.uint32) * 39  # '0'-'9', 'a'-'f'
        tl.store(hexs + t * 768 + offs[:, None] * 8 + j[None, :], ch.to(tl.uint8), mask=keep[:, None])
