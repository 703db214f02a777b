"""The shape of a model, read from a HF `config.json`: ModelConfig, and MoeConfig for its experts.

Validation raises ValueError naming the offending field; nothing here touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

INDEX_SCALE_BYTES = 16  # an FP8 index key's fp32 scale and padding, after its bytes
LATENT_SCALE_BYTES = 16  # a latent row's own fp32 scale (8-bit rows) and padding, after it


@dataclass(frozen=True)
class MoeConfig:
    """Mixture of experts in the decoder layers `layers` (the others keep a dense MLP): each token
    goes to top_k of num_experts routed experts (SiLU-gated MLPs of intermediate_size), plus
    the shared experts (one gated MLP of shared_intermediate_size; 0: none) that every token
    takes.

    Routing from fp32 router logits. scoring softmax (Qwen3-MoE): the top_k probabilities,
    renormalized if norm_topk_prob. scoring sigmoid (GLM-4.5, DeepSeek-V3 `noaux_tc`): experts
    chosen by sigmoid + e_score_correction_bias (correction_bias) among the topk_group best of
    n_group groups (a group's score: its two best), weighted by their sigmoid, renormalized if
    norm_topk_prob, times routed_scaling_factor.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]
    shared_intermediate_size: int = 0
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    # the engine's choice, not the checkpoint's: shared experts stacked after the routed ones
    # where their sizes allow (layers.moe.MoE; --disable-shared-experts-fusion clears it)
    fuse_shared: bool = True

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func: {self.scoring!r} is not supported (softmax, sigmoid)")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok: {self.top_k} for {self.num_experts} experts")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group: {self.n_group} groups, topk_group {self.topk_group}, "
                             f"for {self.num_experts} experts")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], num_layers: int) -> MoeConfig | None:
        """Qwen3-MoE (num_experts, decoder_sparse_step, mlp_only_layers) and GLM-4.5 /
        DeepSeek-V3 (n_routed_experts, first_k_dense_replace, shared experts, groups) names;
        None for a dense model."""
        num = hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts")
        if not num:
            return None
        if hf.get("mlp_layer_types"):  # (GLM-5: "dense" | "sparse" a layer)
            layers = [i for i, kind in enumerate(hf["mlp_layer_types"][:num_layers])
                      if kind == "sparse"]
        elif "first_k_dense_replace" in hf:
            step = hf.get("moe_layer_freq", 1)
            layers = [i for i in range(num_layers)
                      if i >= hf["first_k_dense_replace"] and i % step == 0]
        else:
            skip = set(hf.get("mlp_only_layers") or [])
            step = hf.get("decoder_sparse_step", 1)
            layers = [i for i in range(num_layers) if i not in skip and (i + 1) % step == 0]
        v2 = (hf.get("architectures") or [""])[0] == "DeepseekV2ForCausalLM"
        scoring = hf.get("scoring_func") or (
            "sigmoid" if "n_routed_experts" in hf and not v2 else "softmax")
        method = hf.get("topk_method") or ("noaux_tc" if scoring == "sigmoid" else "greedy")
        if method not in ("greedy", "noaux_tc"):
            raise ValueError(f"topk_method: {method!r} is not supported (greedy, noaux_tc)")
        grouped = method == "noaux_tc"  # (greedy ignores n_group and topk_group)
        return cls(num_experts=num, top_k=hf["num_experts_per_tok"],
                   intermediate_size=hf["moe_intermediate_size"], layers=tuple(layers),
                   shared_intermediate_size=hf["moe_intermediate_size"]
                   * hf.get("n_shared_experts", 0),
                   scoring=scoring,
                   # (DeepSeek-V2 never renormalizes, whatever its config says)
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)) and not v2,
                   n_group=(hf.get("n_group") or 1) if grouped else 1,
                   topk_group=(hf.get("topk_group") or 1) if grouped else 1,
                   routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                   correction_bias=method == "noaux_tc")


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries through a low-rank
    q_lora_rank bottleneck (None: one projection), keys and values from a kv_lora_rank latent
    per token plus one qk_rope_head_dim rotary key shared by all heads; the cache keeps only
    those (kv_lora_rank + qk_rope_head_dim values a token and layer). rope_interleave: the
    rotary dims rotate in adjacent pairs (DeepSeek's layout) instead of two halves."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MlaConfig | None:
        if "kv_lora_rank" not in hf:
            return None
        v2 = (hf.get("architectures") or [""])[0] == "DeepseekV2ForCausalLM"
        return cls(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                   qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                   q_lora_rank=hf.get("q_lora_rank"),
                   rope_interleave=v2 or bool(hf.get("rope_interleave", True)))


@dataclass(frozen=True)
class DsaConfig:
    """DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2) over MLA: a lightning indexer scores
    every cached token for each query (num_heads heads of head_dim: ReLU(q . k), weighted per
    head) and attention reads only the topk best, or every token while a context holds at most
    topk. full_layers run the indexer; any other layer reuses the selection of the full layer
    before it (layer 0 is full). The latent cache's row grows by head_dim values: the indexer's
    key (its first rope_dim dims rotated in adjacent pairs)."""

    topk: int
    num_heads: int
    head_dim: int
    full_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DsaConfig | None:
        """index_topk / index_n_heads / index_head_dim, and indexer_types ("full" | "shared" a
        layer; without it, transformers' default from index_topk_pattern or index_topk_freq and
        index_skip_topk_offset)."""
        if "index_topk" not in hf:
            return None
        num_layers = hf["num_hidden_layers"]
        kinds = hf.get("indexer_types")
        if kinds is None and hf.get("index_topk_pattern") is not None:
            pattern = hf["index_topk_pattern"]
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(
                pattern, str) else list(pattern)
        if kinds is None:
            freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                     for i in range(num_layers)]
        if len(kinds) < num_layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
            raise ValueError(f"indexer_types: {kinds!r} (one of 'full' / 'shared' a layer, "
                             "the first 'full')")
        if hf["index_topk"] < 1 or hf["qk_rope_head_dim"] > hf["index_head_dim"]:
            raise ValueError(f"index_topk: {hf['index_topk']}, index_head_dim "
                             f"{hf['index_head_dim']} (at least qk_rope_head_dim)")
        return cls(topk=hf["index_topk"], num_heads=hf["index_n_heads"],
                   head_dim=hf["index_head_dim"],
                   full_layers=tuple(i for i in range(num_layers) if kinds[i] == "full"))


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of the Llama family (Llama, SmolLM2, Qwen2, Qwen3 dense) and its
    mixture-of-experts kin (Qwen3-MoE, GLM-4.5).

    Flags instead of forks: qkv_bias (Qwen2, GLM attention_bias), o_bias (Llama attention_bias),
    qk_norm (Qwen3), tie_word_embeddings, rope_scaling (Llama 3.1 'llama3' or 'linear'),
    rotary_dim (GLM: RoPE on the first head_dim * partial_rotary_factor dims of each head), moe,
    mla (DeepSeek-V2/V3: then num_kv_heads 1 and head_dim the latent's size, the cache's shape),
    dsa (GLM-5: sparse attention over MLA, the indexer's key appended to the cache's row).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    rotary_dim: int | None = None  # None: the whole head
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None
    dsa: DsaConfig | None = None

    @property
    def kv_parts(self) -> int:
        """Tensors the KV cache keeps per layer: K and V, or MLA's latent alone."""
        return 1 if self.mla is not None else 2

    @property
    def latent_width(self) -> int:
        """MLA: the values of a cache row before the DSA index key, [latent | rotary key]."""
        return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim

    def cache_width(self, fp8: bool, row_scaled: bool = False) -> int:
        """Values (bytes, for 8-bit) of a cache row a token and KV head: head_dim, but an FP8 DSA
        row's index key takes 16 bytes more (its fp32 scale, padded: rows stay 16-byte
        aligned, see ops.torch_ref.dsa), and so does an MLA latent row that carries its own
        scale (row_scaled: ops.torch_ref.kv_quant)."""
        extra = INDEX_SCALE_BYTES if (fp8 or row_scaled) and self.dsa is not None else 0
        return self.head_dim + extra + (LATENT_SCALE_BYTES if row_scaled else 0)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads "
                             f"{self.num_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ValueError(f"partial_rotary_factor: {self.rotary_dim} rotary dims of "
                             f"{self.head_dim}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a HF `config.json` dict (Llama / Qwen2 / Qwen3 / Mistral conventions)."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("architectures: missing from config.json")
        arch = archs[0]
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        partial = rope.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor", 1.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        is_qwen2 = arch.startswith("Qwen2")
        is_glm = arch.startswith("Glm") and "kv_lora_rank" not in hf  # (GLM-5's MLA: as V3's)
        attention_bias = bool(hf.get("attention_bias", False))
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        mla = MlaConfig.from_hf(hf)
        dsa = DsaConfig.from_hf(hf) if mla is not None else None
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        if mla is not None:  # the cache's one "head": the latent and the rotary key (+ index key)
            num_kv_heads = 1
            head_dim = mla.kv_lora_rank + mla.qk_rope_head_dim + (dsa.head_dim if dsa else 0)
            partial = mla.qk_rope_head_dim / head_dim
        eos = hf.get("eos_token_id")
        if not eos_token_ids and eos is not None:
            eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not (is_qwen2 or is_glm),
            qk_norm=arch.startswith("Qwen3") or bool(hf.get("use_qk_norm", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            rotary_dim=round(head_dim * partial) if partial != 1.0 else None,
            moe=MoeConfig.from_hf(hf, hf["num_hidden_layers"]),
            mla=mla,
            dsa=dsa,
        )


def first_layers(c: ModelConfig, num_layers: int) -> ModelConfig:
    """The model cut to its first num_layers decoder layers (`--num-layers`: a model too large
    for one GPU runs at its real per-layer shapes); the checkpoint's later layers are skipped."""
    if not 1 <= num_layers <= c.num_layers:
        raise ValueError(f"num_layers: {num_layers} (the model has 1 to {c.num_layers})")
    moe = c.moe if c.moe is None else replace(
        c.moe, layers=tuple(i for i in c.moe.layers if i < num_layers))
    dsa = c.dsa if c.dsa is None else replace(
        c.dsa, full_layers=tuple(i for i in c.dsa.full_layers if i < num_layers))
    return replace(c, num_layers=num_layers, moe=moe, dsa=dsa)
