"""GPTQ (Frantar et al., 2022), the offline algorithm of `frugal quantize --method gptq` (nothing
that serves imports it).

For INT4 weights: quantize a matrix column by column, pushing each column's rounding error onto
the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs (H = Σ x xᵀ
over calibration tokens), so the layer's output moves as little as the 4-bit grid allows. Groups
get their scale and zero when their first column comes up (from the weights as updated so far);
or, with act_order, columns go in order of decreasing H[j, j] (the inputs with the most energy
first, while the most columns remain to absorb their error) and each group's scale and zero come
from the original weights ("static groups", so a group stays one contiguous run of inputs on
disk). Either way a group's range is clipped: of the factors in SHRINK, the one whose rounding
error Σ H[k, k] (w - q)² is least shrinks it (the grid search of the paper's reference code,
weighted by each input's energy).

Hessians come from the engine itself: forward pre-hooks on a layer's matmuls accumulate the
inputs the matmul sees (after a fused RMSNorm) while calibration text runs through. `sequential`
goes layer by layer, as the paper's reference code does: layer i's Hessians are collected with
layers 0..i-1 already quantized, so each layer also compensates the errors of those before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from frugal.layers.linear import Linear
from frugal.ops.torch_ref.norm import rms_norm
from frugal.quant.fp8 import FP8, FP8_MAX, Fp8Weight, quantize_fp8
from frugal.quant.int4 import Int4Weight, group_params, pack


@contextlib.contextmanager
def hessians(model: nn.Module, prefix: str = "model.layers."
             ) -> Iterator[dict[str, torch.Tensor]]:
    """While open, every Linear whose name starts with prefix adds xᵀx of its inputs ([in, in],
    fp64 on the CPU) to the yielded dict under its module name; the count of rows is under
    name + '#'."""
    found: dict[str, torch.Tensor] = {}
    handles = []

    def hook(name: str):
        def pre(module: Linear, args: tuple, kwargs: dict) -> None:
            x = args[0]
            norm = kwargs.get("norm", args[1] if len(args) > 1 else None)
            if norm is not None:
                x = rms_norm(x, norm.weight, norm.eps)
            x = x.detach().to("cpu", torch.float64).reshape(-1, x.shape[-1])
            if name not in found:
                found[name] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
                found[name + "#"] = torch.zeros((), dtype=torch.float64)
            found[name].addmm_(x.t(), x)
            found[name + "#"] += x.shape[0]
        return pre

    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.startswith(prefix):
            handles.append(module.register_forward_pre_hook(hook(name), with_kwargs=True))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def first_layers(model: nn.Module, n: int) -> Iterator[None]:
    """While open, the model's forward runs only its first n decoder layers (model.model.layers
    cut short; the final norm and the logits then read layer n - 1's output)."""
    decoder = model.model
    all_layers = decoder.layers
    decoder.layers = all_layers[:n]
    try:
        yield
    finally:
        decoder.layers = all_layers


Quantized = Int4Weight | Fp8Weight
SHRINK = torch.linspace(1.0, 0.7, 16).tolist()  # range factors a group's clipping tries


def clipped_group_params(w: torch.Tensor, energy: torch.Tensor, symmetric: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., groups, size], energy [groups, size] (H's diagonal for those inputs) -> scale and
    integer zero [..., groups] as quant.int4.group_params gives for w scaled by the factor of
    SHRINK with the least Σ energy · (w - q)², q the group rounded to nearest (1.0 included:
    never worse than no clipping)."""
    best = None
    for factor in SHRINK:
        scale, zero = group_params(w * factor, symmetric)
        q = (torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15)
             - zero[..., None]) * scale[..., None]
        err = ((w - q) ** 2 * energy).sum(-1)
        if best is None:
            best = [err, scale, zero]
        else:
            better = err < best[0]
            best = [torch.where(better, err, best[0]), torch.where(better, scale, best[1]),
                    torch.where(better, zero, best[2])]
    return best[1], best[2]


def sequential(model: nn.Module, calibrate: Callable[[], None],
               layers: dict[int, list[tuple[str, torch.Tensor, str]]],
               quantize: Callable[[torch.Tensor, torch.Tensor], Quantized],
               progress: Callable[[int], None] = lambda layer: None) -> dict[str, Quantized]:
    """Layer-by-layer GPTQ. model: the engine's model (unquantized; each layer's weights are
    replaced by their dequantized results as it goes, so the next layer calibrates on them);
    calibrate(): runs the calibration text through the model once (while layer i calibrates,
    the model runs only its layers 0..i: the ones after cannot change layer i's inputs);
    layers: layer index -> [(checkpoint name, weight [N, K], name of the model's Linear it
    feeds)]; quantize(weight, hessian [K, K] per calibration row) -> the quantized matrix.
    Returns name -> quantized."""
    done: dict[str, Quantized] = {}
    for layer in sorted(layers):
        with (hessians(model, prefix=f"model.layers.{layer}.") as found,
              first_layers(model, layer + 1)):
            calibrate()
        for name, weight, module in layers[layer]:
            done[name] = quantize(weight, found[module] / found[module + "#"])
        model.load_weights(((name, done[name].dequantize()) for name, _, _ in layers[layer]),
                           strict=False)
        progress(layer)
    return done


def gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool,
         damp: float = 0.01, block: int = 128, act_order: bool = False) -> Int4Weight:
    """weight [N, K] float, hessian [K, K] (xᵀx of the inputs; any positive scale) -> INT4 with
    integer zeros, as quant.int4.quantize_rtn but error-compensated. damp: fraction of the mean
    diagonal added to H for a stable Cholesky factorization."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size: {k} inputs do not split into groups of {group_size}")
    scales = torch.zeros(n, k // group_size, dtype=torch.float64)
    zeros = torch.zeros_like(scales)
    codes = torch.zeros(n, k, dtype=torch.uint8)
    energy = torch.diag(hessian).double().view(-1, group_size)
    if act_order:  # static groups: from the original weights (inputs never seen: as 0)
        alive = (energy != 0).double().view(-1)
        scales, zeros = clipped_group_params((weight.double() * alive).view(n, -1, group_size),
                                             energy, symmetric)

    def round_column(col: int, w_col: torch.Tensor, ahead) -> torch.Tensor:
        g = col // group_size
        if not act_order and col % group_size == 0:
            scale, zero = clipped_group_params(ahead()[:, None, :group_size], energy[g:g + 1],
                                               symmetric)
            scales[:, g], zeros[:, g] = scale[:, 0], zero[:, 0]
        q = torch.round(w_col / scales[:, g] + zeros[:, g]).clamp(0, 15)
        codes[:, col] = q.to(torch.uint8)
        return (q - zeros[:, g]) * scales[:, g]

    _compensate(weight, hessian, round_column, damp, block, act_order)
    return Int4Weight(pack(codes), scales.float(), zeros=zeros.float())


def gptq_fp8(weight: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01,
             block: int = 128, act_order: bool = True) -> Fp8Weight:
    """GPTQ onto the FP8 e4m3 grid with one scale per output channel (amax / 448 of the
    original weights): as quant.fp8.quantize_fp8, error-compensated."""
    scale = quantize_fp8(weight).scales.double()[:, 0]
    data = torch.zeros(weight.shape, dtype=FP8)

    def round_column(col: int, w_col: torch.Tensor, ahead) -> torch.Tensor:
        q = (w_col / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        data[:, col] = q
        return q.double() * scale

    _compensate(weight, hessian, round_column, damp, block, act_order)
    return Fp8Weight(data, scale.float()[:, None])


def _compensate(weight: torch.Tensor, hessian: torch.Tensor, round_column, damp: float,
                block: int, act_order: bool) -> None:
    """The GPTQ sweep: round_column(original column index, its current values [N], ahead: a
    function giving the columns from it on in quantization order [N, *]) rounds one column and
    returns what it became; its error is spread over the columns not yet rounded through the
    inverse Hessian's Cholesky factor. act_order: columns in order of decreasing H[j, j]."""
    k = weight.shape[1]
    w = weight.double().clone()
    h = hessian.double().clone()
    dead = torch.diag(h) == 0  # inputs that were always 0: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    for start in range(0, k, block):
        stop = min(start + block, k)
        w_block = w[:, start:stop].clone()
        errors = torch.zeros_like(w_block)
        h_block = hinv[start:stop, start:stop]
        for j in range(stop - start):
            def ahead(j: int = j, w_block: torch.Tensor = w_block, stop: int = stop
                      ) -> torch.Tensor:
                return torch.cat([w_block[:, j:], w[:, stop:]], dim=1)

            done = round_column(int(order[start + j]), w_block[:, j], ahead)
            error = (w_block[:, j] - done) / h_block[j, j]
            w_block[:, j:] -= error[:, None] * h_block[j, j:][None, :]
            errors[:, j] = error
        w[:, stop:] -= errors @ hinv[start:stop, stop:]
