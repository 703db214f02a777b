"""The Llama family in one file, via flags: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 dense,
with mixture-of-experts layers (layers.moe) Qwen3-MoE and GLM-4.5, and with latent attention
DeepSeek-V2/V3 and Kimi K2, and with sparse attention over it GLM-5: the attention of each
decoder layer comes from the config's backend (layers.attention: mha, mla or dsa).

Parameter names follow HF transformers so checkpoints load as they are; q/k/v and gate/up are fused
into one matmul each and filled shard by shard (packed_modules), per-expert tensors into their
expert's slice of the stacked expert weights. Under tensor parallelism (frugal.parallel) every
rank builds the same model with its share of heads, features and vocabulary, and its loaders
take their slices of the checkpoint's full tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from frugal.config import ModelConfig
from frugal.layers.attention import AttentionMetadata, backend_for
from frugal.layers.embedding import VocabEmbedding
from frugal.layers.linear import Linear, load_whole
from frugal.layers.mlp import GatedMLP
from frugal.layers.moe import MoE
from frugal.layers.norm import RMSNorm
from frugal.layers.rotary import RotaryEmbedding
from frugal.parallel import SINGLE, Parallel
from frugal.quant.fp8 import Fp8Weight
from frugal.quant.int4 import Int4Weight


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, index: int,
                 parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # mha, mla or dsa (layers.attention): every kind takes and returns the DSA selection
        self.self_attn = backend_for(c).layer(c, rotary, index, parallel)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = (MoE(c, parallel) if c.moe is not None and index in c.moe.layers
                    else GatedMLP(c.hidden_size, c.intermediate_size, parallel))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                selection: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: [num_tokens, hidden], the residual stream, in and out, with the sparse-attention
        selection handed from layer to layer (layers.attention.mla; None without DSA). Each norm
        is fused into the matmul after it and each residual add into the matmul before it
        (ops.linear)."""
        h, selection = self.self_attn(h, self.input_layernorm, positions, meta, selection)
        if isinstance(self.mlp, MoE):
            return self.mlp(h, self.post_attention_layernorm), selection
        return self.mlp(h, self.post_attention_layernorm, residual=h), selection


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, parallel)
        rotary = RotaryEmbedding(c.rotary_dim or c.head_dim, c.max_position_embeddings,
                                 c.rope_theta, c.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, rotary, i, parallel)
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        selection = None
        for layer in self.layers:
            h, selection = layer(h, positions, meta, selection)
        return self.norm(h)


# model.layers.N.self_attn.k_scale (compressed-tensors), ...self_attn.k_proj.k_scale (ModelOpt)
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:\w+\.)?([kv])_scale$")
# one routed expert's matrix: model.layers.L.mlp.experts.N.gate_proj.weight
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    """forward -> final hidden states [num_tokens, hidden]; compute_logits -> [n, vocab] fp32."""

    # checkpoint projection name -> (fused parameter, shard id)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        if config.mla is not None:  # (MLA's q_proj is its own matrix)
            self.packed_modules = {k: v for k, v in self.packed_modules.items()
                                   if v[0] == "gate_up_proj"}
        self.model = LlamaModel(config, parallel)
        # FP8-KV checkpoints' k_scale / v_scale tensors, (layer, "k" | "v") -> tensor
        self.kv_scales_found: dict[tuple[int, str], torch.Tensor] = {}
        vocab = self.model.embed_tokens.rows  # (vocab-parallel: the embedding's rows)
        self.lm_head = Linear(config.hidden_size, vocab[1],
                              rows=vocab if parallel.size > 1 else None)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] logits, fp32 unless upcast is False (then the model's
        dtype: half the bytes for a greedy argmax, which picks the same token either way)."""
        logits = self.lm_head(hidden)
        if self.parallel.size > 1:
            logits = self.parallel.all_gather(logits, self.parallel.parts(self.config.vocab_size))
        return logits.float() if upcast else logits

    def attention_layers(self) -> list[nn.Module]:
        """The modules the model runner binds each layer's cache to (k_cache, v_cache,
        kv_scales): each layer's attention or its `attn` (layers.attention.base)."""
        return [getattr(layer.self_attn, "attn", layer.self_attn) for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     strict: bool = True) -> None:
        """Load HF-named tensors; strict: every parameter (every shard of a fused one) must be
        filled (else: replace just the ones given, as GPTQ does layer by layer)."""
        params = dict(self.named_parameters())
        pending = {name: self._shards(name, param) for name, param in params.items()}
        for name, tensor in weights:
            scale = _KV_SCALE.search(name)
            if scale:
                self.kv_scales_found[int(scale.group(1)), scale.group(2)] = tensor
                continue
            if "rotary_emb" in name or (name == "lm_head.weight"
                                        and self.config.tie_word_embeddings):
                continue
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= self.config.num_layers:
                continue  # layers past the model's (GLM's multi-token prediction layer)
            target, shard = name, None
            expert = _EXPERT.match(name)
            if expert:
                prefix, index, part = expert.groups()
                target = f"{prefix}.{'down' if part == 'down' else 'gate_up'}_proj"
                shard = (int(index), part)
            else:
                for ckpt_name, (fused, shard_id) in self.packed_modules.items():
                    if f".{ckpt_name}." in name:
                        target, shard = name.replace(ckpt_name, fused), shard_id
                        break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            loader = getattr(param, "weight_loader", load_whole)
            try:
                if isinstance(tensor, (Int4Weight, Fp8Weight)):
                    self.get_submodule(target.rsplit(".", 1)[0]).load_quantized(tensor, shard)
                else:
                    loader(param, tensor.to(param.dtype), shard)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            pending[target] = set() if shard is None else pending[target] - {shard, None}
        missing = sorted(name for name, shards in pending.items() if shards)
        if missing and strict:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")

    def _shards(self, name: str, param: nn.Parameter) -> set:
        """What must be loaded into a parameter: its shards (all of a fused one's, or an
        expert tensor's per-expert slices), else None for the whole tensor. A parameter whose
        shards include None may instead come whole (stacked experts)."""
        shards = getattr(param, "shards", None)
        if shards is None:
            shards = getattr(self.get_submodule(name.rsplit(".", 1)[0]), "shards", [None])
        return set(shards)
