"""Word-level pieces of the int8 GEMVs (`q8`): `dp4a` (four int8 products summed into an int32) and the
loads that keep a run's 32-bit words in the thread that loaded them.

Why in the thread: loaded as [N, G, 4] tensors, Triton spreads a run's four words over four lanes and
gathers them back through shared memory before every dp4a chain (a barrier each). A 16-byte aligned run is
one 128-bit load (`ld4`), an 8-byte aligned one two 64-bit loads (`ld2`), a 4-byte aligned one four 32-bit
loads (`ld_words`); a 2-byte aligned one (Q4_0's and IQ4_NL's 18-byte blocks put every other block's runs 2
bytes past a word) is five aligned 32-bit loads funnel-shifted into four words (`ld_run`).

Under Triton's interpreter (`TRITON_INTERPRET=1`, CI without a GPU) there is no inline PTX: dp4a and the
16-value dot are their byte products summed in NumPy (`triton/interpreted.py`), the loads are plain `tl.load`s
and the shift is two shifts and a mask, so the interpreted kernels sum exactly what the PTX instructions sum.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from fuselane.lanes.cuda.triton import interpreted
from fuselane.lanes.cuda.triton.gemv.fast import PAIR
from fuselane.lanes.cuda.triton.gemv.layout import (
    BYTE,
    BYTE_BITS,
    HALF_WORD_BITS,
)

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")  # no inline PTX under the interpreter
WORD_BYTES = tl.constexpr(4)
PRMT_PICK = tl.constexpr(0x7)  # the bits of a `prmt` selector nibble that pick one of 8 bytes
WORD_START = tl.constexpr(-4)  # the mask that rounds an address down to its word
HALF_WORD = tl.constexpr(0xFFFF)


@triton.jit
def dp4a(a, b, c, SIGNED: tl.constexpr):
    """c + the dot product of a's four bytes (signed bytes where SIGNED, else unsigned) with b's four signed
    bytes, all int32."""
    a = a.to(tl.int32, bitcast=True)
    if INTERPRETED:
        return interpreted.DP4A(a, b, c, SIGNED)
    elif SIGNED:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def dot16(w, a, SIGNED: tl.constexpr):
    """[N, G, 4] words of codes times [N, G, 4] words of int8 activations: the 16-value dot, [N, G] int32,
    as a chain of four dp4a (each adds into the last)."""
    if INTERPRETED:
        return interpreted.DOT16(w.to(tl.int32, bitcast=True), a, SIGNED)
    w02, w13 = tl.split(tl.reshape(w, [w.shape[0], w.shape[1], PAIR, PAIR]))
    a02, a13 = tl.split(tl.reshape(a, [a.shape[0], a.shape[1], PAIR, PAIR]))
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    a0, a2 = tl.split(a02)
    a1, a3 = tl.split(a13)
    c = dp4a(w0, a0, tl.zeros_like(a0), SIGNED)
    c = dp4a(w1, a1, c, SIGNED)
    c = dp4a(w2, a2, c, SIGNED)
    return dp4a(w3, a3, c, SIGNED)


@triton.jit
def words(v):
    """[N, G, 4, 2] 2-byte words (little-endian pairs) -> [N, G, 4] 32-bit words."""
    lo, hi = tl.split(v)
    return lo | (hi << HALF_WORD_BITS)


@triton.jit
def ld4(ptr, WEIGHTS: tl.constexpr, PINNED: tl.constexpr = False):
    """The 16 bytes at each 16-byte aligned address of `ptr` ([N, G]) as four int32 tensors, one 128-bit load
    a thread: the words stay in the thread that loaded them, where a [N, G, 4] load would hand them to four
    lanes and `dot16` would gather them back through shared memory (a barrier each). Weights take the
    read-only path and leave L1 first; activations (written by the kernel before) the coherent one, and
    the asm is not pure, so it stays behind `pdl.wait`. PINNED weights take the coherent path too (see
    `weight_loads`: a `bar.sync` after them keeps ptxas from sinking them to their sums)."""
    if INTERPRETED:
        p = ptr.to(tl.pointer_type(tl.int32))
        return tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)
    elif WEIGHTS and PINNED:
        return tl.inline_asm_elementwise(
            "ld.global.L1::evict_first.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1,
        )  # fmt: skip
    elif WEIGHTS:
        return tl.inline_asm_elementwise(
            "ld.global.nc.L1::evict_first.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def dot16_of(w0, w1, w2, w3, a0, a1, a2, a3, SIGNED: tl.constexpr):
    """`dot16` on words held apart ([N, G] each)."""
    return dp4a(w3, a3, dp4a(w2, a2, dp4a(w1, a1, dp4a(w0, a0, tl.zeros_like(a0), SIGNED), SIGNED), SIGNED), SIGNED)


@triton.jit
def _ld5(ptr, last, PINNED: tl.constexpr):
    """The four 32-bit words from each 4-byte aligned address of `ptr` ([N, G] int32 pointers) and the word at
    `last`, weights' loads (read-only path, or the coherent one where PINNED; out of L1 first), each word in
    the thread that loaded it."""
    if INTERPRETED:
        return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3), tl.load(last)
    elif PINNED:
        return tl.inline_asm_elementwise(
            "ld.global.L1::evict_first.b32 $0, [$5];\n\tld.global.L1::evict_first.b32 $1, [$5+4];\n\t"
            "ld.global.L1::evict_first.b32 $2, [$5+8];\n\tld.global.L1::evict_first.b32 $3, [$5+12];\n\t"
            "ld.global.L1::evict_first.b32 $4, [$6];", "=r,=r,=r,=r,=r,l,l", [ptr, last],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            "ld.global.nc.L1::evict_first.b32 $0, [$5];\n\tld.global.nc.L1::evict_first.b32 $1, [$5+4];\n\t"
            "ld.global.nc.L1::evict_first.b32 $2, [$5+8];\n\tld.global.nc.L1::evict_first.b32 $3, [$5+12];\n\t"
            "ld.global.nc.L1::evict_first.b32 $4, [$6];", "=r,=r,=r,=r,=r,l,l", [ptr, last],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def ld_words(ptr, PINNED: tl.constexpr = False):
    """The 16 bytes at each 4-byte aligned address of `ptr` ([N, G] byte pointers) as four int32 words in the
    thread: four aligned 32-bit weight loads (read-only path, or the coherent one where PINNED; out of L1
    first), where `ld_run` would read a fifth and shift (the runs of Q4_1's 20-byte, Q5_1's 24-byte, IQ4_XS's
    136-byte and Q2_K's 84-byte blocks all start on a word)."""
    p = ptr.to(tl.pointer_type(tl.int32))
    if INTERPRETED:
        return tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)
    elif PINNED:
        return tl.inline_asm_elementwise(
            "ld.global.L1::evict_first.b32 $0, [$4];\n\tld.global.L1::evict_first.b32 $1, [$4+4];\n\t"
            "ld.global.L1::evict_first.b32 $2, [$4+8];\n\tld.global.L1::evict_first.b32 $3, [$4+12];",
            "=r,=r,=r,=r,l", [p], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            "ld.global.nc.L1::evict_first.b32 $0, [$4];\n\tld.global.nc.L1::evict_first.b32 $1, [$4+4];\n\t"
            "ld.global.nc.L1::evict_first.b32 $2, [$4+8];\n\tld.global.nc.L1::evict_first.b32 $3, [$4+12];",
            "=r,=r,=r,=r,l", [p], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def ld2(ptr, PINNED: tl.constexpr = False):
    """The 8 bytes at each 8-byte aligned address of `ptr` ([N, G] byte pointers) as two int32 words in the
    thread, one 64-bit weight load (read-only path, or the coherent one where PINNED; out of L1 first): half
    the instructions of `ld_words` where a format's blocks keep their runs on 8 bytes (IQ4_XS's 136-byte
    blocks)."""
    p = ptr.to(tl.pointer_type(tl.int32))
    if INTERPRETED:
        return tl.load(p), tl.load(p + 1)
    elif PINNED:
        return tl.inline_asm_elementwise(
            "ld.global.L1::evict_first.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [p],
            dtype=(tl.int32, tl.int32), is_pure=False, pack=1,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            "ld.global.nc.L1::evict_first.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [p],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def ld_scalar(ptr, BYTES: tl.constexpr):
    """The unsigned BYTES-byte (1, 2 or 4) weight field at each naturally aligned address of `ptr` ([N, G] byte
    pointers), as int32, loaded by inline asm as the runs are (`ld4`, `ld_words`, `ld_run`): a `tl.load`
    beside them takes a layout of its own, and Triton converts between the two through shared memory (a
    barrier each) in the loop."""
    if INTERPRETED:
        if BYTES == 1:
            return tl.load(ptr).to(tl.int32)
        elif BYTES == 2:
            return tl.load(ptr.to(tl.pointer_type(tl.uint16))).to(tl.int32)
        else:
            return tl.load(ptr.to(tl.pointer_type(tl.int32)))
    elif BYTES == 1:
        return (
            tl.inline_asm_elementwise(
                "ld.global.nc.L1::evict_first.u8 $0, [$1];", "=h,l", [ptr], dtype=tl.int16, is_pure=True, pack=1
            ).to(tl.int32)
            & BYTE
        )
    elif BYTES == 2:
        return (
            tl.inline_asm_elementwise(
                "ld.global.nc.L1::evict_first.u16 $0, [$1];", "=h,l", [ptr], dtype=tl.int16, is_pure=True, pack=1
            ).to(tl.int32)
            & HALF_WORD
        )
    else:
        return tl.inline_asm_elementwise(
            "ld.global.nc.L1::evict_first.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _word_at(lo, hi, shift):
    """The 32 bits `shift` (0 or 16) bits into the 64-bit little-endian pair (lo, hi): a funnel shift."""
    if INTERPRETED:
        return tl.where(shift == 0, lo, ((lo >> HALF_WORD_BITS) & HALF_WORD) | (hi << HALF_WORD_BITS))
    else:
        return tl.inline_asm_elementwise(
            "shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, shift], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def rotl(x, s):
    """Each int32 of `x` rotated left by `s` (0-31) bits: one funnel shift of the word with itself."""
    if INTERPRETED:
        u = x.to(tl.uint32, bitcast=True)
        return ((u << s) | ((u >> 1) >> (31 - s))).to(tl.int32, bitcast=True)
    else:
        return tl.inline_asm_elementwise(
            "shf.l.wrap.b32 $0, $1, $1, $2;", "=r,r,r", [x, s], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def ld_run(ptr, PINNED: tl.constexpr = False):
    """The 16 bytes at each 2-byte aligned address of `ptr` ([N, G] byte pointers) as four int32 words in the
    thread: five aligned words read (four where the run is on a word), then shifted into place (Q4_0's and
    IQ4_NL's 18-byte blocks leave every other block's runs 2 bytes past a word). A run 2 bytes past a word
    reads the 2 bytes after it too. PINNED: the coherent path (`ld4`)."""
    at = ptr.to(tl.int64)
    shift = ((at & (WORD_BYTES - 1)) * BYTE_BITS).to(tl.int32)
    first = (at & WORD_START).to(tl.pointer_type(tl.int32))
    # a run on a word needs only four: the fifth is read again from the fourth's, so no load passes the run
    # (a run at a block's end, as Q4_0's and Q8_0's, would otherwise read 4 bytes past its tensor)
    w0, w1, w2, w3, w4 = _ld5(first, first + tl.where(shift == 0, 3, 4), PINNED)
    return _word_at(w0, w1, shift), _word_at(w1, w2, shift), _word_at(w2, w3, shift), _word_at(w3, w4, shift)


@triton.jit
def prmt(a, b, sel):
    """Each byte i of the result is byte (sel >> 4i) & 7 of the 8 bytes (b:a) (a's bytes 0-3, b's 4-7): PTX's
    `prmt.b32` in its default mode for selector nibbles below 8 (the caller's), all int32."""
    if INTERPRETED:
        out = tl.zeros_like(sel)
        for i in tl.static_range(4):
            k = (sel >> (4 * i)) & PRMT_PICK
            src = tl.where(k < WORD_BYTES, a, b)
            out |= ((src >> ((k % WORD_BYTES) * BYTE_BITS)) & BYTE) << (BYTE_BITS * i)
        return out
    else:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32, is_pure=True, pack=1
        )
