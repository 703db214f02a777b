"""A mixture-of-experts block: router, routed experts and shared experts (Qwen3-MoE, GLM-4.5,
DeepSeek-V3 routing). Parameter names are HF's, so checkpoints load as they are. Tensor
parallelism splits every expert's intermediate features across the ranks (the router is
replicated: every rank routes the same)."""

from __future__ import annotations

import torch
from torch import nn

from frugal import ops
from frugal.layers.mlp import GatedMLP
from frugal.layers.norm import RMSNorm
from frugal.model_config import ModelConfig
from frugal.parallel import SINGLE, Parallel
from frugal.quant.experts import Experts as QuantizedExperts
from frugal.quant.experts import quantize_experts, stack
from frugal.quant.fp8 import Fp8Weight
from frugal.quant.int4 import Int4Weight


class Router(nn.Module):
    """weight: [num_experts, hidden]; e_score_correction_bias: [num_experts] fp32 (sigmoid routing
    with a bias only), used to choose experts, not to weight them."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = None
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)


class Experts(nn.Module):
    """Every routed expert's weights in one tensor each, as transformers 5 keeps them:
    gate_up_proj [num_experts, 2 * inter, hidden] (an expert's gate rows, then its up rows),
    down_proj [num_experts, hidden, inter]. A checkpoint's per-expert tensors
    (experts.N.gate_proj / up_proj / down_proj) fill their slices (shard (N, part)).
    Quantized experts (quant.experts) replace the float tensors once every expert's matrix is
    in: qgate_up and qdown, and the float parameters shrink to nothing.

    spare: rows after the routed experts (num_experts = routed + spare) that MoE.fuse_shared
    fills with the shared experts; the checkpoint never names them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 share: tuple[int, int] | None = None, spare: int = 0) -> None:
        super().__init__()
        self.routed, self.num_experts = num_experts, num_experts + spare
        num_experts = self.num_experts
        self.hidden_size = hidden_size
        # tensor parallelism: this rank's (start, length) of every expert's intermediate features
        self.share, self.full_size = share, intermediate_size
        intermediate_size = share[1] if share else intermediate_size
        self.intermediate_size = intermediate_size
        self.qgate_up: QuantizedExperts | None = None
        self.qdown: QuantizedExperts | None = None
        # quantized matrices loaded so far, (expert, part) -> matrix, until all are in
        self._gate_up: dict[tuple, Int4Weight | Fp8Weight] = {}
        self._down: dict[tuple, Int4Weight | Fp8Weight] = {}
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        for param, parts in ((self.gate_up_proj, ("gate", "up")), (self.down_proj, ("down",))):
            param.weight_loader = self.load
            param.shards = [None, *((e, p) for e in range(self.routed) for p in parts)]

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple | None = None) -> None:
        """shard None: the whole tensor (transformers 5's fused layout); (expert, part)."""
        if self.share is not None:
            loaded = self._narrow(param, loaded, shard)
        if shard is None:
            target = param.data[:self.routed]
        else:
            expert, part = shard
            target = param.data[self._index(expert)]
            if part != "down":
                inter = self.intermediate_size
                target = target[:inter] if part == "gate" else target[inter:]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} in checkpoint, model expects "
                             f"{tuple(target.shape)}")
        target.copy_(loaded)

    def _index(self, expert: int) -> int:
        """A checkpoint's expert number, checked against the routed experts (the spare rows
        after them are never a checkpoint's)."""
        if not 0 <= expert < self.routed:
            raise ValueError(f"expert {expert} in checkpoint, model has {self.routed} experts")
        return expert

    def _narrow(self, param: nn.Parameter, loaded: torch.Tensor,
                shard: tuple | None) -> torch.Tensor:
        """This rank's intermediate features of a checkpoint expert tensor."""
        start, length = self.share
        if shard is None and param is self.gate_up_proj:  # [E, gate rows | up rows, hidden]
            full = self.full_size
            return torch.cat([loaded[:, start:start + length],
                              loaded[:, full + start:full + start + length]], dim=1)
        if shard is None:  # down [E, hidden, inter]
            return loaded[:, :, start:start + length]
        if shard[1] == "down":  # [hidden, inter]
            return loaded[:, start:start + length]
        return loaded[start:start + length]

    def load_quantized(self, loaded: Int4Weight | Fp8Weight, shard: tuple) -> None:
        """One expert's quantized matrix (shard (expert, part)); stacked once all are in."""
        if self.share is not None:
            raise ValueError("tensor_parallel_size: quantized experts are not split across "
                             "ranks yet")
        self._index(shard[0])
        part = shard[1]
        inter, hidden = self.intermediate_size, self.hidden_size
        want = (hidden, inter) if part == "down" else (inter, hidden)
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape {tuple(loaded.shape)} in checkpoint, model expects {want}")
        parts = self._down if part == "down" else self._gate_up
        parts[shard] = loaded
        experts = range(self.routed)  # (spare rows stay float, unfused: see MoE.fuse_shared)
        if part != "down" and len(parts) == 2 * self.routed:
            self.qgate_up = stack([type(parts[e, "gate"]).cat([parts[e, "gate"], parts[e, "up"]])
                                   for e in experts]).to(self.gate_up_proj.device)
            parts.clear()
            self.gate_up_proj.data = self.gate_up_proj.data.new_empty(0)
        if part == "down" and len(parts) == self.routed:
            self.qdown = stack([parts[e, "down"] for e in experts]).to(self.down_proj.device)
            parts.clear()
            self.down_proj.data = self.down_proj.data.new_empty(0)

    def quantize(self, scheme: str) -> None:
        """Round the float experts in place (quant.experts.quantize_experts), a matrix the
        checkpoint did not bring quantized."""
        if self.qgate_up is None:
            self.qgate_up = quantize_experts(self.gate_up_proj.data, scheme)
            self.gate_up_proj.data = self.gate_up_proj.data.new_empty(0)
        if self.qdown is None:
            self.qdown = quantize_experts(self.down_proj.data, scheme)
            self.down_proj.data = self.down_proj.data.new_empty(0)

    def weights(self) -> tuple[torch.Tensor | QuantizedExperts, torch.Tensor | QuantizedExperts]:
        """(gate_up, down) as the MoE ops take them."""
        return (self.gate_up_proj if self.qgate_up is None else self.qgate_up,
                self.down_proj if self.qdown is None else self.qdown)


class MoE(nn.Module):
    """h + Σ_k w_k · expert_k(norm(h)) + shared_experts(norm(h)), for h: [num_tokens, hidden].

    Shared experts whose intermediate size is a multiple S of the routed experts' (Kimi K2's
    and GLM-4.5's one, DeepSeek-V2-Lite's two) load as a gated MLP and may then join the routed
    experts (fuse_shared): S more expert rows, which the routing gives every token at weight
    1.0, so one fused_moe computes both (at decode: two launches less a layer)."""

    def __init__(self, c: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        m = self.config = c.moe
        self.parallel = parallel
        self.gate = Router(m.num_experts, c.hidden_size, m.correction_bias)
        share = parallel.part(m.intermediate_size) if parallel.size > 1 else None
        whole = (m.fuse_shared and parallel.size == 1
                 and m.shared_intermediate_size % m.intermediate_size == 0)
        spare = m.shared_intermediate_size // m.intermediate_size if whole else 0
        self.experts = Experts(m.num_experts, c.hidden_size, m.intermediate_size, share, spare)
        self.fused = 0  # shared experts among self.experts' rows (fuse_shared)
        # (under tensor parallelism the shared experts' partial sum joins the routed one's)
        self.shared_experts = (GatedMLP(c.hidden_size, m.shared_intermediate_size, parallel,
                                        reduce=False)
                               if m.shared_intermediate_size else None)

    def fuse_shared(self) -> bool:
        """After loading: the shared experts copied into the experts' spare rows (their
        intermediate features cut into spare parts of the routed size) and dropped, where there
        are spare rows (config.fuse_shared) and both are float (a checkpoint's quantized routed
        experts keep a float shared MLP apart: Kimi K2's INT4 release). Otherwise the spare
        rows are let go (float routed experts beside a quantized shared MLP: copied once
        without them, a layer at a time). Returns whether they are fused."""
        e = self.experts
        spare = e.num_experts - e.routed
        if self.fused or not spare:
            return bool(self.fused)
        mlp = self.shared_experts
        if (e.qgate_up is None and e.qdown is None
                and getattr(mlp.gate_up_proj, "qweight", None) is None
                and getattr(mlp.down_proj, "qweight", None) is None):
            inter = e.intermediate_size
            gate, up = mlp.gate_up_proj.weight.data.chunk(2)  # [spare * inter, hidden] each
            down = mlp.down_proj.weight.data  # [hidden, spare * inter]
            for j in range(spare):
                rows = slice(j * inter, (j + 1) * inter)
                e.gate_up_proj.data[e.routed + j].copy_(torch.cat([gate[rows], up[rows]]))
                e.down_proj.data[e.routed + j].copy_(down[:, rows])
            self.shared_experts, self.fused = None, spare
            return True
        for param in (e.gate_up_proj, e.down_proj):
            if param.numel():  # (quantized experts' float tensors are empty already)
                param.data = param.data[:e.routed].clone()
        e.num_experts = e.routed
        return False

    def forward(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        m = self.config
        x, weights, ids = ops.norm_route_experts(
            h, norm.weight, norm.eps, self.gate.weight, self.gate.e_score_correction_bias,
            m.top_k, m.scoring, m.norm_topk_prob, m.n_group, m.topk_group,
            m.routed_scaling_factor, self.fused)
        if self.parallel.size > 1:  # (partial sums over the ranks' intermediate features)
            y = ops.fused_moe(x, *self.experts.weights(), weights, ids)
            if self.shared_experts is not None:
                y = y + self.shared_experts(x)
            return h + self.parallel.all_reduce(y)
        y = ops.fused_moe(x, *self.experts.weights(), weights, ids, residual=h)  # h + routed
        return y if self.shared_experts is None else self.shared_experts(x, residual=y)


def fuse_shared_experts(model: nn.Module) -> int:
    """MoE.fuse_shared for every MoE layer, after loading and before quantizing; returns how
    many layers fused theirs."""
    return sum(module.fuse_shared() for module in model.modules() if isinstance(module, MoE))


def quantize_moe(model: nn.Module, scheme: str) -> int:
    """Quantize the routed experts the checkpoint did not bring quantized (quantize_layers does
    the other matmuls); returns how many expert layers were rounded."""
    rounded = 0
    for module in model.modules():
        if isinstance(module, Experts) and (module.qgate_up is None or module.qdown is None):
            module.quantize(scheme)
            rounded += 1
    return rounded
