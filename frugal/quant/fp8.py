"""FP8 (e4m3) weights: one in-memory form for per-channel and 128×128-block scales.

A weight [N, K] is stored as
  data:   [N, K] float8_e4m3fn, the weight divided by its scale and saturated to ±448;
  scales: float32, either [N, 1] (one per output channel: compressed-tensors' "channel"
          strategy) or [ceil(N / block), ceil(K / block)] (one per block × block tile: the
          `weight_block_size: [128, 128]` form of DeepSeek / GLM FP8 checkpoints, whose
          `weight_scale_inv` is this multiplier);
and w = data · scale. With w8a8 the activations are quantized too, dynamically per token
(`quantize_rows`: one scale per row of x, its amax / 448), and the matmul runs in FP8 (W8A8: on
the GPU our split-K kernel for decode batches, torch._scaled_mm for prompts), at every step, so
a token's activations are rounded the same way whatever batch it runs in; without w8a8
activations keep the
model's dtype (W8A16: the GPU kernel widens the weight in registers). On the H200 W8A8 measured
faster at every batch size (docs/benchmarks.md); W8A16 keeps more accuracy (docs/accuracy.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from frugal.quant import divide

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class Fp8Weight:
    data: torch.Tensor
    scales: torch.Tensor
    block: int | None = None  # None: per output channel
    w8a8: bool = False  # activations quantized per token (W8A8)
    _dense: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, k = self.data.shape
        want = (n, 1) if self.block is None else (-(-n // self.block), -(-k // self.block))
        if self.data.dtype != FP8 or tuple(self.scales.shape) != want:
            raise ValueError(f"Fp8Weight: data {tuple(self.data.shape)} {self.data.dtype}, "
                             f"scales {tuple(self.scales.shape)} (expected {want})")
        self.scales = self.scales.float()  # (the FP8 matmuls take fp32 scales only)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype, computed in fp32 and rounded once."""
        n, k = self.shape
        b = self.block
        if b is not None and n % b == 0 and k % b == 0:  # scales broadcast over whole tiles
            tiles = self.data.view(n // b, b, k // b, b).float()
            return (tiles * self.scales.float()[:, None, :, None]).view(n, k).to(dtype)
        return (self.data.float() * expand(self.scales, b, n, k)).to(dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """dequantize(dtype), kept after the first call (the CPU reference path)."""
        if dtype not in self._dense:
            self._dense[dtype] = self.dequantize(dtype)
        return self._dense[dtype]

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scales.to(device), self.block, self.w8a8)

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """Row-wise concatenation (q|k|v, gate|up); block-scaled parts must each have a
        multiple of the block as rows."""
        blocks = {(p.block, p.w8a8) for p in parts}
        if len(blocks) != 1:
            raise ValueError("Fp8Weight.cat: parts differ in scaling")
        block, w8a8 = blocks.pop()
        if block is not None and any(p.shape[0] % block for p in parts[:-1]):
            raise ValueError(f"Fp8Weight.cat: block-scaled parts need rows in multiples of "
                             f"{block}")
        return Fp8Weight(torch.cat([p.data for p in parts]),
                         torch.cat([p.scales for p in parts]), block, w8a8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 of activations x [M, K] -> (q [M, K] e4m3, scales [M, 1] fp32),
    x ≈ q · scale with scale = max|x[m]| / 448 (a zero row: 1e-12 / 448, its codes 0)."""
    x = x.float()
    scale = divide(x.abs().amax(1, keepdim=True).clamp(min=1e-12), FP8_MAX)
    inverse = torch.ones_like(scale) / scale  # (one IEEE division a row, as the GPU kernel)
    return (x * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as a W8A8 matmul sees it: quantize_rows, then q · scale in x's dtype."""
    q, scale = quantize_rows(x)
    return (q.float() * scale).to(x.dtype)


def quantize_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 of activations x [M, K] per row and group of `group` consecutive inputs ->
    (q [M, K] e4m3, scales [M, ceil(K / group)] fp32): quantize_rows on each group (the last
    one as long as K leaves it)."""
    m, k = x.shape
    groups = x.float().new_zeros(m, -(-k // group) * group)
    groups[:, :k] = x.float()
    groups = groups.view(m, -1, group)
    scale = divide(groups.abs().amax(2, keepdim=True).clamp(min=1e-12), FP8_MAX)
    inverse = torch.ones_like(scale) / scale
    q = (groups * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, -1)[:, :k], scale[:, :, 0]


def round_groups(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x [M, K] as W8A8 experts see it: quantize_groups, then q · scale (fp32) in x's dtype."""
    m, k = x.shape
    q, scale = quantize_groups(x, group)
    return (q.float() * scale.repeat_interleave(group, 1)[:, :k]).to(x.dtype)


def quantize_fp8(weight: torch.Tensor, block: int | None = None, w8a8: bool = False
                 ) -> Fp8Weight:
    """Round-to-nearest FP8 of a float [N, K] weight: scale = amax / 448 per output channel
    (block None) or per block × block tile; an all-zero channel or tile gets scale 1."""
    w = weight.float()
    n, k = w.shape
    if block is None:
        scale = divide(w.abs().amax(1, keepdim=True), FP8_MAX)
    else:
        rows, cols = -(-n // block) * block, -(-k // block) * block
        padded = torch.zeros(rows, cols, device=w.device)
        padded[:n, :k] = w
        tiles = padded.view(rows // block, block, cols // block, block)
        scale = divide(tiles.abs().amax((1, 3)), FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = (w / expand(scale, block, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(data, scale, block, w8a8)


def expand(scales: torch.Tensor, block: int | None, n: int, k: int) -> torch.Tensor:
    """Scales broadcastable to [n, k]: [n, 1] as they are, block scales repeated per element."""
    if block is None:
        return scales.float()
    return scales.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def quantization_config(block: int | None, ignore: list[str], w8a8: bool = True) -> dict:
    """config.json's entry for an FP8 checkpoint: compressed-tensors' float-quantized format
    (per-channel weight scales; activations dynamic per token if w8a8, else none named: kept)
    or, with block scales, the `quant_method: fp8` form with weight_block_size that DeepSeek
    and GLM checkpoints use (whose activations this engine keeps)."""
    if block is not None:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [block, block], "modules_to_not_convert": ignore}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ignore,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": {**fp8, "strategy": "channel"},
                "input_activations": ({**fp8, "dynamic": True, "strategy": "token"}
                                      if w8a8 else None)}}}


def checkpoint_form(q: dict | None) -> tuple[int | None, bool] | None:
    """(block size or None for per-channel/per-tensor scales, w8a8) of an FP8
    quantization_config, None when the checkpoint is not FP8. w8a8: the config quantizes
    activations (dynamically per token here, whatever granularity it names); block-scaled
    weights keep them in the model's dtype."""
    if not q:
        return None
    if q.get("quant_method") == "fp8":
        size = q.get("weight_block_size")
        if size is not None and (len(size) != 2 or size[0] != size[1]):
            raise ValueError(f"quantization_config: square weight blocks only, got {size}")
        return (None, True) if size is None else (int(size[0]), False)
    if q.get("quant_method") == "compressed-tensors" and q.get("format") == "float-quantized":
        w8a8 = False
        for group in q.get("config_groups", {}).values():
            w8a8 = w8a8 or bool(group.get("input_activations"))
            w = group.get("weights", {})
            if w.get("num_bits") != 8 or w.get("type") != "float":
                raise ValueError(f"quantization_config: float-quantized weights must be 8-bit "
                                 f"float, got {w}")
            if w.get("strategy") not in ("channel", "tensor"):
                raise ValueError(f"quantization_config: FP8 weight strategy "
                                 f"{w.get('strategy')!r} (channel or tensor)")
        return (None, w8a8)
    return None


def to_tensors(prefix: str, q: Fp8Weight) -> dict[str, torch.Tensor]:
    """`prefix.weight` and its scales as the checkpoint forms above store them."""
    name = "weight_scale" if q.block is None else "weight_scale_inv"
    return {f"{prefix}.weight": q.data.contiguous(),
            f"{prefix}.{name}": q.scales.contiguous()}


def from_tensors(data: torch.Tensor, scale: torch.Tensor, block: int | None,
                 w8a8: bool = False) -> Fp8Weight:
    """An FP8 weight from a checkpoint's tensors; a per-tensor scale becomes per channel."""
    if data.dtype != FP8:
        raise ValueError(f"FP8 checkpoint: weight is {data.dtype}, expected float8_e4m3fn")
    if block is None:
        if scale.numel() == 1:
            scale = scale.reshape(1, 1).expand(data.shape[0], 1)
        scale = scale.reshape(-1, 1).contiguous()
    return Fp8Weight(data, scale, block, w8a8)
