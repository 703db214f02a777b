"""INT4 weights on disk in compressed-tensors' "pack-quantized" format (what llm-compressor
writes, and Kimi K2's native INT4 checkpoints use).

For a weight `X.weight` [N, K] the checkpoint holds
  X.weight_packed      [N, K / 8] int32: signed codes q in [-8, 7] stored as q + 8, eight per
                       word, element k at bits 4 * (k % 8) (the layout of quant.int4);
  X.weight_scale       [N, K / group];
  X.weight_zero_point  [ceil(N / 8), K / group] int32, asymmetric only: signed zero points zp,
                       packed the same way down the output dimension;
  X.weight_shape       [2] int64 = (N, K);
and w = (q - zp) · scale. config.json's quantization_config says so (see quantization_config).
"""

from __future__ import annotations

import torch

from frugal.quant.int4 import Int4Weight, pack, unpack

SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def quantization_config(group_size: int, symmetric: bool, ignore: list[str]) -> dict:
    """The config.json entry of a W4A16 checkpoint with group-wise scales."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": group_size, "dynamic": False, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}}}


def int4_group(hf_config: dict) -> tuple[int, bool] | None:
    """(group size, symmetric) of a pack-quantized W4A16 config.json, None when the checkpoint
    is not quantized; ValueError for quantization this loader does not read."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "pack-quantized":
        raise ValueError(f"quantization_config: only compressed-tensors pack-quantized is "
                         f"supported, got {q.get('quant_method')!r} / {q.get('format')!r}")
    groups = list(q.get("config_groups", {}).values())
    if len(groups) != 1 or groups[0].get("input_activations"):
        raise ValueError("quantization_config: one weight-only config group is supported")
    w = groups[0]["weights"]
    if w.get("num_bits") != 4 or w.get("type") != "int" or w.get("strategy") != "group":
        raise ValueError(f"quantization_config: only 4-bit int group-wise weights, got {w}")
    return int(w["group_size"]), bool(w.get("symmetric", True))


def to_tensors(prefix: str, q: Int4Weight, scale_dtype: torch.dtype = torch.float32
               ) -> dict[str, torch.Tensor]:
    """`prefix.weight_*` tensors of an integer-zero INT4 weight (zero 8 everywhere: symmetric,
    no zero point). A weight with float mins (GGUF Q4_1) has no exact form here."""
    if q.zeros is None:
        raise ValueError(f"{prefix}: a weight with float mins has no pack-quantized form")
    n, k = q.shape
    out = {f"{prefix}.weight_packed": q.packed.contiguous(),
           f"{prefix}.weight_scale": q.scales.to(scale_dtype).contiguous(),
           f"{prefix}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not bool((q.zeros == 8).all()):
        zp = q.zeros.to(torch.int64)  # 8 + signed zero point: already the stored code
        rows = -(-n // 8) * 8
        zp = torch.cat([zp, torch.full((rows - n, zp.shape[1]), 8, dtype=torch.int64)])
        out[f"{prefix}.weight_zero_point"] = pack(zp.t().contiguous()).t().contiguous()
    return out


def from_tensors(tensors: dict[str, torch.Tensor]) -> Int4Weight:
    """The INT4 weight of one layer from its weight_* tensors (keys: the suffixes)."""
    n, k = (int(v) for v in tensors["weight_shape"].tolist())
    packed = tensors["weight_packed"].to(torch.int32)
    if packed.shape != (n, k // 8):
        raise ValueError(f"weight_packed: shape {tuple(packed.shape)} for a [{n}, {k}] weight")
    scales = tensors["weight_scale"]
    zero_point = tensors.get("weight_zero_point")
    if zero_point is None:
        zeros = torch.full(scales.shape, 8.0)
    else:
        zeros = unpack(zero_point.to(torch.int32).t().contiguous()).t()[:n].float()
    return Int4Weight(packed, scales, zeros=zeros)
