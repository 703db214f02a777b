"""One 128-input tile of int4_wgmma's kernel: weight words into wgmma A operands, the MMAs,
and each group's (scale, min) folded into the fp32 accumulator.

A warp's A fragment of a 16-row slab holds, per 16 inputs, the pairs at inputs (2t, 2t+1) and
(2t+8, 2t+9) (t = lane % 4) of rows g and g+8 (g = lane / 4): the words of int4_linear's layout
give exactly that, two codes of a pair 16 bits apart, so one shift and one LOP3 make an operand
register (bits MAGIC | code: the number OFFSET + code); the joins and the permute in `_operand`
only rename registers (checked by `convert_layout(..., assert_trivial=True)` at compile time).
Per group, Σ x (OFFSET + u) comes from the weights' MMA and Σ x from an MMA with ones, and
Σ_k x_k w_k = scale · Σ x (OFFSET + u) + (min - OFFSET · scale) · Σ x. Up to 16 rows a group's
MMAs are issued together and waited for once; beyond, one by one (fewer live registers), except
for CENTERED weights (symmetric: every min is -8 · scale, and only the scales are stored), whose
operand is code - 8 (one more FMA per register) and which need no Σ x: their MMAs are issued
together at any BLOCK_M.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _operand(words, LAYOUT: gl.constexpr, dtype: gl.constexpr, CENTERED: gl.constexpr):
    """words [S, 2 (h), 8 (g), 4 (t), 1] int32 of rows 16 s + 8 h + g -> [16 S, 32] in dtype
    (OFFSET + code, or code - 8 if CENTERED) in LAYOUT (the wgmma A operand): input
    16 a + 8 b + 2 t + c from nibble (2 a + b) + 4 c of word t."""
    u = words.to(gl.uint32, bitcast=True)
    s1 = (u >> 4).to(gl.int32, bitcast=True)
    s2 = (u >> 8).to(gl.int32, bitcast=True)
    s3 = (u >> 12).to(gl.int32, bitcast=True)
    j = gl.join(gl.join(words, s1), gl.join(s2, s3))  # [S, h, g, t, 1, 2 (b), 2 (a)]
    j = gl.join(j, j)  # [..., b, a, 2 (c)]
    if CENTERED:  # (OFFSET + code) · 1 - (OFFSET + 8), exact
        if dtype == gl.bfloat16:
            pairs = gl.inline_asm_elementwise(
                "{.reg .b32 t, one, c; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; "
                "mov.b32 one, 0x3F803F80; mov.b32 c, 0xC308C308; fma.rn.bf16x2 $0, t, one, c;}",
                "=r,r,r", [j], dtype=gl.bfloat16, is_pure=True, pack=2)
        else:
            pairs = gl.inline_asm_elementwise(
                "{.reg .b32 t, c; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; "
                "mov.b32 c, 0x64086408; sub.f16x2 $0, t, c;}",
                "=r,r,r", [j], dtype=gl.float16, is_pure=True, pack=2)
    elif dtype == gl.bfloat16:
        pairs = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;",
                                          "=r,r,r", [j], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        pairs = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xEA;",
                                          "=r,r,r", [j], dtype=gl.float16, is_pure=True, pack=2)
    pairs = gl.permute(pairs, (0, 1, 2, 4, 6, 5, 3, 7))  # [S, h, g, 1, a, b, t, c]
    BN: gl.constexpr = 16 * words.shape[0]
    return gl.convert_layout(gl.reshape(pairs, (BN, 32)), LAYOUT, assert_trivial=True)


@gluon.jit
def _quarters(words):
    """A tile's words [S, 2, 8, 4 (t), 4 (q)] -> the four [S, 2, 8, 4, 1] of q = 0..3."""
    w = gl.reshape(words, (words.shape[0], 2, 8, 4, 2, 2))  # q = 2 q1 + q0
    lo, hi = gl.split(gl.permute(w, (0, 1, 2, 3, 5, 4)))  # q1 = 0, 1
    q0, q1 = gl.split(lo)
    q2, q3 = gl.split(hi)
    return (gl.expand_dims(q0, 4), gl.expand_dims(q1, 4), gl.expand_dims(q2, 4),
            gl.expand_dims(q3, 4))


@gluon.jit
def _params(p, dtype: gl.constexpr, CENTERED: gl.constexpr):
    """A group's (scale, min) pairs (int32: scale in the low half, both in dtype) -> fp32;
    CENTERED: its scales (int16, in dtype) -> fp32, the mins -8 · scale."""
    if CENTERED:
        scale = p.to(dtype, bitcast=True).to(gl.float32)
        low = -8.0 * scale
    else:
        scale = p.to(gl.int16).to(dtype, bitcast=True).to(gl.float32)
        low = (p >> 16).to(gl.int16).to(dtype, bitcast=True).to(gl.float32)
    return scale, low


@gluon.jit
def _chunk(x_smem, stage, c: gl.constexpr):
    """Inputs 32 c.. of a stage's tile as the B operand [32, BM] (x_smem [STAGES, 4 BM, 32]:
    chunk c in rows c BM..)."""
    BM: gl.constexpr = x_smem.shape[1] // 4
    return x_smem.index(stage).slice(c * BM, BM).permute((1, 0))


@gluon.jit
def _products(quarters, x_smem, stage, part, g: gl.constexpr, CHUNKS: gl.constexpr,
              a_layout: gl.constexpr, ASYNC: gl.constexpr, CENTERED: gl.constexpr):
    """part + group g's Σ x (OFFSET + u) (Σ x (u - 8) if CENTERED) [BN, BM]: its CHUNKS
    quarters' words against x's chunks (ASYNC: asynchronous MMAs, a token until waited for)."""
    for c in gl.static_range(CHUNKS):
        x_b = _chunk(x_smem, stage, g * CHUNKS + c)  # [32, BM]
        part = warpgroup_mma(_operand(quarters[g * CHUNKS + c], a_layout, x_smem.dtype,
                                      CENTERED), x_b, part, is_async=ASYNC)
    return part


@gluon.jit
def _fold(acc, part, x_sum, p_smem, row: gl.constexpr, OFFSET: gl.constexpr,
          dtype: gl.constexpr, acc_layout: gl.constexpr, CENTERED: gl.constexpr):
    """acc + a group's products scaled by the (scale, min) pairs of p_smem's row `row` (if
    CENTERED, its scales: every min is -8 · scale, the products alone)."""
    scale, low = _params(p_smem.slice(row, 1).permute((1, 0)).load(acc_layout), dtype,
                         CENTERED)
    if CENTERED:
        return acc + part * scale  # ([BN, 1] broadcast)
    return acc + part * scale + x_sum * (low - OFFSET * scale)


@gluon.jit
def tile(words, words_up, x_smem, stage, p_smem, ones, acc, acc_up, GATED: gl.constexpr,
          G: gl.constexpr, OFFSET: gl.constexpr, a_layout: gl.constexpr,
          acc_layout: gl.constexpr, ASYNC: gl.constexpr, CENTERED: gl.constexpr):
    """acc (and acc_up) [BN, BM] + one 128-input tile's products: words (words_up) [S, 2, 8, 4,
    4], x_smem [STAGES, 4 BM, 32] (rows c BM..: the tile's inputs 32 c..), p_smem
    [halves · G, BN] the tile's (scale, min) pairs (CENTERED: scales). ASYNC: a group's MMAs
    (Σ x with ones, the weights', the up half's) are issued together and waited for once (more
    registers).
    CENTERED (symmetric codes): the weights as u - 8, and no Σ x."""
    CHUNKS: gl.constexpr = 4 // G  # 32-input chunks per group
    dtype: gl.constexpr = x_smem.dtype
    quarters = _quarters(words)
    quarters_up = _quarters(words_up) if GATED else quarters
    for g in gl.static_range(G):
        x_sum = gl.zeros_like(acc)
        if not CENTERED:
            for c in gl.static_range(CHUNKS):
                x_sum = warpgroup_mma(ones, _chunk(x_smem, stage, g * CHUNKS + c),
                                      x_sum, is_async=ASYNC)
        part = _products(quarters, x_smem, stage, gl.zeros_like(acc), g, CHUNKS, a_layout, ASYNC,
                         CENTERED)
        part_up = part
        if GATED:
            part_up = _products(quarters_up, x_smem, stage, gl.zeros_like(acc), g, CHUNKS,
                                a_layout, ASYNC, CENTERED)
        if ASYNC:
            x_sum, part, part_up = _wait(x_sum, part, part_up, GATED, CENTERED)
        if GATED:
            acc_up = _fold(acc_up, part_up, x_sum, p_smem, G + g, OFFSET, dtype, acc_layout,
                           CENTERED)
        acc = _fold(acc, part, x_sum, p_smem, g, OFFSET, dtype, acc_layout, CENTERED)
    return acc, acc_up


@gluon.jit
def _wait(x_sum, part, part_up, GATED: gl.constexpr, CENTERED: gl.constexpr):
    """Wait for a group's asynchronous MMAs (part_up, if not GATED, is returned as given)."""
    if GATED and CENTERED:
        part, part_up = warpgroup_mma_wait(0, deps=[part, part_up])
    elif GATED:
        x_sum, part, part_up = warpgroup_mma_wait(0, deps=[x_sum, part, part_up])
    elif CENTERED:
        part = warpgroup_mma_wait(0, deps=[part])
    else:
        x_sum, part = warpgroup_mma_wait(0, deps=[x_sum, part])
    return x_sum, part, part_up
