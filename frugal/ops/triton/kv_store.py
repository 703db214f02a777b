"""Writing new keys and values into the paged cache, fused with the rotary embedding (and, for an
8-bit cache, with the quantization: x / scale, saturated to the FP8 range for static scales; for
rows that carry their own scale, the row's amax sets it: ops.torch_ref.kv_quant)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from frugal.ops.torch_ref.kv_quant import QMAX, row_scaled, scale_view
from frugal.ops.triton.launch import enter, pdl
from frugal.ops.triton.sizes import next_power_of_2


@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, q_out_ptr,
                         k_out_ptr, k_cache_ptr, v_cache_ptr, scales_ptr, k_scale_ptr, v_scale_ptr,
                         q_stride, k_stride, v_stride, qw_ptr, kw_ptr, eps,
                         QK_NORM: tl.constexpr, NUM_HEADS: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                         KV_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                         DIM: tl.constexpr, PASS: tl.constexpr, PASS_PAD: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, K_ROW: tl.constexpr,
                         V_ROW: tl.constexpr, K_SROW: tl.constexpr, V_SROW: tl.constexpr,
                         K_QMAX: tl.constexpr, V_QMAX: tl.constexpr, K_OUT: tl.constexpr,
                         PDL: tl.constexpr):
    """One program per token: rotate its q heads into q_out, rotate its k heads and store them
    with its v heads at its slot (unless the slot is negative). Each head's first 2 * HALF dims
    rotate, its last PASS dims (partial rotary; DIM = 2 * HALF + PASS) pass through. FP8
    (static): divided by the head's scale (scales_ptr: [2, NUM_KV_HEADS], K then V) and
    saturated; V key-minor ([pages, NUM_KV_HEADS, DIM, PAGE_SIZE]). K_ROW, V_ROW: elements
    from one (slot, head) row of the cache to the next. K_SROW / V_SROW > 0: K / V rows carry
    their scale (ops.torch_ref.kv_quant: amax / K_QMAX), row r's at k_scale_ptr + r * K_SROW.
    QK_NORM: every q and k head RMS-normalized first (weights qw_ptr, kw_ptr [DIM]; rounded to
    the activation dtype as ops.rms_norm rounds). K_OUT: every token's rotated k also goes to
    k_out_ptr ([tokens, NUM_KV_HEADS, DIM] in q's dtype), whatever its slot."""
    enter(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, HALF_PAD)
    i_mask = i < HALF
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + i, mask=i_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + i, mask=i_mask, other=0.0)[None, :]
    p = 2 * HALF + tl.arange(0, PASS_PAD)  # the dims that pass through
    h = tl.arange(0, HEADS_PAD)[:, None]
    mask = (h < NUM_HEADS) & i_mask[None, :]
    src = q_ptr + t * q_stride + h * DIM + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    q_pass = (h < NUM_HEADS) & (p[None, :] < DIM)
    xp = tl.load(q_ptr + t * q_stride + h * DIM + p[None, :], mask=q_pass, other=0.0)
    if QK_NORM:
        x1, x2, xp = _head_norm(x1, x2, xp, qw_ptr, i, i_mask, p, eps, HALF, DIM, PASS)
    dst = q_out_ptr + (t * NUM_HEADS + h) * DIM + i[None, :]
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)
    if PASS > 0:
        tl.store(q_out_ptr + (t * NUM_HEADS + h) * DIM + p[None, :], xp.to(out_ty), mask=q_pass)
    slot = tl.load(slot_ptr + t)
    if K_OUT:
        k_rot1, k_rot2, k_pass = _rotated_k(k_ptr + t * k_stride, cos, sin, kw_ptr, i, i_mask, p,
                                            eps, QK_NORM, NUM_KV_HEADS, KV_PAD, HALF, DIM, PASS)
        j = tl.arange(0, KV_PAD)[:, None]
        k_dst = k_out_ptr + (t * NUM_KV_HEADS + j) * DIM
        kv_mask = (j < NUM_KV_HEADS) & i_mask[None, :]
        tl.store(k_dst + i[None, :], k_rot1.to(out_ty), mask=kv_mask)
        tl.store(k_dst + HALF + i[None, :], k_rot2.to(out_ty), mask=kv_mask)
        if PASS > 0:
            tl.store(k_dst + p[None, :], k_pass.to(out_ty),
                     mask=(j < NUM_KV_HEADS) & (p[None, :] < DIM))
    if slot >= 0:  # -1 marks padding (a CUDA graph's unused rows)
        # (names differ from the q block's: Triton needs one shape per variable)
        j = tl.arange(0, KV_PAD)[:, None]
        kv_mask = (j < NUM_KV_HEADS) & i_mask[None, :]
        kv_pass = (j < NUM_KV_HEADS) & (p[None, :] < DIM)
        if not K_OUT:
            k_rot1, k_rot2, k_pass = _rotated_k(k_ptr + t * k_stride, cos, sin, kw_ptr, i, i_mask,
                                                p, eps, QK_NORM, NUM_KV_HEADS, KV_PAD, HALF, DIM,
                                                PASS)
        row = slot * NUM_KV_HEADS + j  # [KV_PAD, 1]
        kv_dst = row * K_ROW + i[None, :]
        k_scale = tl.full([KV_PAD, 1], 1.0, tl.float32)
        v_scale = tl.full([KV_PAD, 1], 1.0, tl.float32)
        if FP8:
            k_scale = tl.load(scales_ptr + j, mask=j < NUM_KV_HEADS, other=1.0)
            v_scale = tl.load(scales_ptr + NUM_KV_HEADS + j, mask=j < NUM_KV_HEADS, other=1.0)
        if K_SROW > 0:  # the row's amax over all its dims sets its scale
            amax = tl.maximum(tl.max(finite_abs(k_rot1), 1), tl.max(finite_abs(k_rot2), 1))
            if PASS > 0:
                amax = tl.maximum(amax, tl.max(finite_abs(k_pass), 1))
            k_scale = tl.math.div_rn(amax, K_QMAX)[:, None]  # (IEEE: torch_ref's bits)
            tl.store(k_scale_ptr + row * K_SROW, k_scale, mask=j < NUM_KV_HEADS)
        store_quantized(k_cache_ptr + kv_dst, k_rot1, k_scale, kv_mask, FP8, K_SROW > 0)
        store_quantized(k_cache_ptr + kv_dst + HALF, k_rot2, k_scale, kv_mask, FP8, K_SROW > 0)
        if PASS > 0:
            store_quantized(k_cache_ptr + row * K_ROW + p[None, :], k_pass, k_scale, kv_pass,
                            FP8, K_SROW > 0)
        d = tl.arange(0, 2 * HALF_PAD)  # V's dims, all DIM of them (in two halves' worth)
        if V_SROW > 0:  # a first pass for the row's amax
            amax = tl.zeros([KV_PAD], tl.float32)
            for start in tl.static_range(0, DIM, 2 * HALF_PAD):
                v_mask = (j < NUM_KV_HEADS) & ((start + d)[None, :] < DIM)
                x = tl.load(v_ptr + t * v_stride + j * DIM + start + d[None, :], mask=v_mask,
                            other=0.0)
                amax = tl.maximum(amax, tl.max(finite_abs(x), 1))
            v_scale = tl.math.div_rn(amax, V_QMAX)[:, None]
            tl.store(v_scale_ptr + row * V_SROW, v_scale, mask=j < NUM_KV_HEADS)
        for start in tl.static_range(0, DIM, 2 * HALF_PAD):
            v_mask = (j < NUM_KV_HEADS) & ((start + d)[None, :] < DIM)
            x = tl.load(v_ptr + t * v_stride + j * DIM + start + d[None, :], mask=v_mask,
                        other=0.0)
            if FP8:  # key-minor: dim e of head j at ((page * heads + j) * DIM + e) * page + off
                v_dst = (((slot // PAGE_SIZE) * NUM_KV_HEADS + j) * DIM + start + d[None, :]) \
                    * PAGE_SIZE + slot % PAGE_SIZE
            else:
                v_dst = row * V_ROW + start + d[None, :]
            store_quantized(v_cache_ptr + v_dst, x, v_scale, v_mask, FP8, V_SROW > 0)


@triton.jit
def _rotated_k(src, cos, sin, kw_ptr, i, i_mask, p, eps, QK_NORM: tl.constexpr,
               NUM_KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr, HALF: tl.constexpr,
               DIM: tl.constexpr, PASS: tl.constexpr):
    """One token's k heads (src: its first, heads DIM apart), normalized where QK_NORM and
    rotated: (first half, second half, passing dims) [KV_PAD, *], each rounded to k's dtype
    first, as the unfused path stores a rotated k tensor."""
    j = tl.arange(0, KV_PAD)[:, None]
    kv_mask = (j < NUM_KV_HEADS) & i_mask[None, :]
    k1 = tl.load(src + j * DIM + i[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(src + j * DIM + HALF + i[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    kv_pass = (j < NUM_KV_HEADS) & (p[None, :] < DIM)
    k_pass = tl.load(src + j * DIM + p[None, :], mask=kv_pass, other=0.0)
    x_ty = src.dtype.element_ty
    if QK_NORM:
        k1, k2, k_pass = _head_norm(k1, k2, k_pass, kw_ptr, i, i_mask, p, eps, HALF, DIM, PASS)
        k_pass = k_pass.to(x_ty)
    return (k1 * cos - k2 * sin).to(x_ty), (k2 * cos + k1 * sin).to(x_ty), k_pass


@triton.jit
def _head_norm(x1, x2, xp, w_ptr, i, i_mask, p, eps, HALF: tl.constexpr, DIM: tl.constexpr,
               PASS: tl.constexpr):
    """Each row (a head: its rotating halves x1, x2 [rows, HALF_PAD] fp32 and its passing dims
    xp [rows, PASS_PAD]) RMS-normalized over its DIM dims and scaled by w (ops.rms_norm's
    rounding: to xp's dtype after the normalization and after the weight), returned in fp32."""
    ty = xp.dtype
    xpf = xp.to(tl.float32)
    squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
    if PASS > 0:
        squares += tl.sum(xpf * xpf, 1)
    inv = (1.0 / tl.sqrt(squares / DIM + eps))[:, None]
    w1 = tl.load(w_ptr + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + p, mask=p < DIM, other=0.0).to(tl.float32)[None, :]
    y1 = (w1 * (x1 * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    y2 = (w2 * (x2 * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    yp = (wp * (xpf * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    return y1, y2, yp


@triton.jit
def finite_abs(x):
    """|x| in fp32 with NaN as 0 and inf as the largest float32 (as the row's values are)."""
    y = x.to(tl.float32)
    return tl.minimum(tl.abs(tl.where(y == y, y, 0.0)), 3.4028234663852886e38)


@triton.jit
def store_quantized(ptr, x, scale, mask, FP8: tl.constexpr, ROW_SCALED: tl.constexpr = False):
    """Store x in the cache's dtype; FP8 (static): x / scale, saturated to ±448, NaN stored as
    0 (an FP8 pool never holds NaN: the attention kernels read whole last pages). ROW_SCALED:
    x / its row's scale (0 for a row of zeros) rounded to e4m3 or int8 (half away from zero)."""
    if FP8:  # (div_rn: IEEE division, torch_ref's bits; `/` is approximate on the GPU)
        y = tl.math.div_rn(x.to(tl.float32), scale)
        y = tl.clamp(tl.where(y == y, y, 0.0), -448.0, 448.0)
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)
    elif ROW_SCALED:
        y = x.to(tl.float32)
        y = tl.minimum(tl.maximum(tl.where(y == y, y, 0.0), -3.4028234663852886e38),
                       3.4028234663852886e38)
        y = tl.where(scale > 0, tl.math.div_rn(y, tl.where(scale > 0, scale, 1.0)), 0.0)
        if ptr.dtype.element_ty == tl.int8:
            y = tl.clamp(y, -127.0, 127.0)
            y = tl.where(y < 0, -tl.floor(0.5 - y), tl.floor(y + 0.5))
        else:
            y = tl.clamp(y, -448.0, 448.0)
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


def heads_packed(x: torch.Tensor) -> torch.Tensor:
    """x with heads and head_dim densely packed (tokens may be strided, as in a fused qkv)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                    k_out: torch.Tensor | None = None) -> torch.Tensor:
    """See torch_ref.rotary_store_kv. q, k, v may be views of one fused qkv projection; k_out
    must be contiguous."""
    q, k, v = heads_packed(q), heads_packed(k), heads_packed(v)
    num_tokens, num_heads, head_dim = q.shape
    k_rows, v_rows = (row_scaled(c, head_dim, kv_scales) for c in (k_cache, v_cache))
    fp8 = k_cache.dtype == torch.float8_e4m3fn and not k_rows
    if fp8 and kv_scales is None:
        raise ValueError("an FP8 KV cache needs kv_scales")
    k_scales = scale_view(k_cache, head_dim) if k_rows else k_cache  # (any tensor: not read)
    v_scales = scale_view(v_cache, head_dim) if v_rows else k_cache
    num_kv_heads, half = k.shape[1], cos_sin.shape[1] // 2
    passed = head_dim - 2 * half
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if k_out is not None and (not k_out.is_contiguous() or k_out.shape != k.shape
                              or k_out.dtype != q.dtype):
        raise ValueError("k_out: must be a contiguous [num_tokens, num_kv_heads, head_dim] "
                         "tensor in q's dtype")
    launch_pdl = pdl(q.device)
    _rotary_store_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin, slot_mapping, out, out if k_out is None else k_out,
        k_cache, v_cache, kv_scales if fp8 else k_cache, k_scales, v_scales, q.stride(0),
        k.stride(0), v.stride(0), *(qk_norm if qk_norm is not None else (q, q, 0.0)),
        QK_NORM=qk_norm is not None, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_heads), KV_PAD=next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=next_power_of_2(half), DIM=head_dim, PASS=passed,
        PASS_PAD=next_power_of_2(max(passed, 1)), PAGE_SIZE=k_cache.shape[1], FP8=fp8,
        K_ROW=k_cache.stride(2), V_ROW=0 if fp8 else v_cache.stride(2),
        K_SROW=k_scales.stride(2) if k_rows else 0, V_SROW=v_scales.stride(2) if v_rows else 0,
        K_QMAX=QMAX.get(k_cache.dtype, 1.0), V_QMAX=QMAX.get(v_cache.dtype, 1.0),
        K_OUT=k_out is not None, PDL=launch_pdl, launch_pdl=launch_pdl > 0)
    return out
