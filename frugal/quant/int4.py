"""INT4 weights (W4A16, group-wise): one in-memory form for every source.

A weight [N, K] is stored as
  packed: [N, K / 8] int32, compressed-tensors' "pack-quantized" layout: the unsigned 4-bit code
          u in [0, 15] of element k sits at bits 4 * (k % 8) of word k // 8 (u = signed + 8);
  scales: [N, K / group] float, one per group of `group` consecutive inputs of a row;
  and one of
  zeros:  [N, K / group] float holding integers: w = (u - zero) · scale (symmetric: zero 8;
          compressed-tensors' signed zero point zp: zero = 8 + zp; GGUF Q4_0: zero 8), or
  mins:   [N, K / group] float: w = u · scale + min (GGUF Q4_1, whose min is not a multiple of
          its scale).
Each form dequantizes with the arithmetic of its source, so weights read from a compressed-
tensors checkpoint or a GGUF file come out bit-identical to what those formats define.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from frugal.quant import divide

GROUP_SIZES = (32, 64, 128)


@dataclass
class Int4Weight:
    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    _dense: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.zeros is None) == (self.mins is None):
            raise ValueError("Int4Weight: exactly one of zeros and mins")
        n, words = self.packed.shape
        if self.packed.dtype != torch.int32 or self.scales.shape[0] != n:
            raise ValueError(f"Int4Weight: packed {tuple(self.packed.shape)} "
                             f"{self.packed.dtype}, scales {tuple(self.scales.shape)}")
        groups = self.scales.shape[1]
        if (words * 8) % groups:
            raise ValueError(f"Int4Weight: {words * 8} inputs do not split into {groups} groups")
        extra = self.zeros if self.zeros is not None else self.mins
        if extra.shape != self.scales.shape:
            raise ValueError("Int4Weight: zeros/mins must have the scales' shape")

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def codes(self) -> torch.Tensor:
        """The unsigned codes u: [N, K] uint8."""
        return unpack(self.packed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype, computed in fp32 with the source format's arithmetic."""
        n, k = self.shape
        u = self.codes().float().view(n, -1, self.group_size)
        s = self.scales.float()[:, :, None]
        if self.zeros is not None:
            w = (u - self.zeros.float()[:, :, None]) * s
        else:
            w = s * u + self.mins.float()[:, :, None]
        return w.reshape(n, k).to(dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """dequantize(dtype), kept after the first call: the CPU reference path multiplies
        with it (a GPU kernel dequantizes in registers instead; the CPU is not where INT4
        saves memory)."""
        if dtype not in self._dense:
            self._dense[dtype] = self.dequantize(dtype)
        return self._dense[dtype]

    def to(self, device: torch.device | str) -> Int4Weight:
        return Int4Weight(*(None if t is None else t.to(device)
                            for t in (self.packed, self.scales, self.zeros, self.mins)))

    def permute_rows(self, order: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.packed[order], self.scales[order],
                          None if self.zeros is None else self.zeros[order],
                          None if self.mins is None else self.mins[order])

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Row-wise concatenation (q|k|v, gate|up); all parts of one form and group size."""
        forms = {(p.zeros is None, p.group_size) for p in parts}
        if len(forms) != 1:
            raise ValueError("Int4Weight.cat: parts differ in form or group size")

        def cat(name: str) -> torch.Tensor | None:
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors)

        return Int4Weight(cat("packed"), cat("scales"), cat("zeros"), cat("mins"))


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in [0, 15] (any integer dtype; K a multiple of 8) -> [N, K / 8] int32."""
    n, k = codes.shape
    if k % 8:
        raise ValueError(f"pack: {k} inputs is not a multiple of 8")
    u = codes.to(torch.int64).view(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (u << shifts).sum(-1)  # < 2**32
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack: [N, W] int32 -> [N, 8 W] uint8 codes."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 0xF).to(torch.uint8).flatten(1)


def group_params(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero of each group (the last dim of w), as quantize_rtn sets them;
    scales rounded to fp32 (as stored)."""
    if symmetric:
        scale = divide(w.abs().amax(-1), 7.5)
        zero = torch.full_like(scale, 8.0)
    else:
        lo = w.amin(-1).clamp(max=0.0)
        hi = w.amax(-1).clamp(min=0.0)
        scale = divide(hi - lo, 15.0)
        zero = torch.round(-lo / torch.where(scale > 0, scale, 1.0)).clamp(0, 15)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    return scale.float().to(w.dtype), zero


def quantize_rtn(weight: torch.Tensor, group_size: int, symmetric: bool,
                 scale_dtype: torch.dtype = torch.float32) -> Int4Weight:
    """Round-to-nearest INT4 of a float [N, K] weight (K a multiple of group_size).

    symmetric: scale = amax / 7.5 per group (codes -8..7 around zero 8, like compressed-tensors'
    symmetric int4), zero 8. asymmetric: scale = (max - min) / 15 over a range that includes 0,
    integer zero = round(-min / scale), clamped to [0, 15]. Scales are kept in fp32, or in bf16
    (scale_dtype; as compressed-tensors checkpoints such as Kimi K2's store them: 0.5 bytes a
    weight less at group 32) rounded up, so that the codes still span the group, and the codes
    rounded with the scale as stored.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size: {k} inputs do not split into groups of {group_size}")
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize_rtn: scales in fp32 or bf16, not {scale_dtype}")
    w = weight.float().view(n, k // group_size, group_size)
    scale, zero = group_params(w, symmetric)
    if scale_dtype == torch.bfloat16:  # (bf16: fp32's top half; one more is the next bf16 up)
        rounded = scale.to(torch.bfloat16).float()
        up = (rounded.view(torch.int32) + (1 << 16)).view(torch.float32)
        scale = torch.where(rounded < scale, up, rounded).to(torch.bfloat16)
    codes = torch.round(w / scale.float()[..., None] + zero[..., None]).clamp(0, 15)
    return Int4Weight(pack(codes.view(n, k)), scale, zeros=zero)
