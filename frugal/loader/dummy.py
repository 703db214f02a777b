"""Random weights at real shapes (`--load-format dummy`), for benchmarks without a checkpoint."""

from __future__ import annotations

import torch

from frugal.config import ModelConfig

# HF config.json fields of well-known shapes; only the shapes matter for dummy weights.
PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "dtype": "bfloat16",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
    },
    "glm-4.5-air": {  # 106 B: bf16 needs two GPUs; --num-layers or --quantization for one
        "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 4096,
        "intermediate_size": 10944, "num_hidden_layers": 46, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
        "attention_bias": True, "use_qk_norm": False, "first_k_dense_replace": 1,
        "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408, "routed_scaling_factor": 1.0, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "bos_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "dtype": "bfloat16",
    },
}


class DummyCheckpoint:
    """Random weights for any parameter the model asks for. init "uniform" (the default): every
    floating parameter, norm weights included, uniform in [-1e-3, 1e-3] from a generator seeded
    afresh for each parameter, as vLLM's dummy loader fills them, so that both engines route
    MoE tokens alike and read the same expert bytes (Kimi K2's router, sigmoid plus a
    correction bias, on normed random states: 64 tokens reach 12 of its 384 experts with such
    weights, 238 with N(0, 0.02²) ones). init "normal": N(0, 0.02²), norm weights 1 (logits
    far apart, fewer near ties). EngineConfig checks the name (config.DUMMY_INITS)."""

    def __init__(self, config: ModelConfig, tokenizer=None, seed: int = 0,
                 init: str = "uniform") -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.seed = seed
        self.init = init

    def load_into(self, model: torch.nn.Module) -> None:
        """Overwrite every parameter of `model` in place (deterministic for a seed and device)."""
        gen = None
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            if self.init == "uniform":
                gen = torch.Generator(device=param.device).manual_seed(self.seed)
                param.data.uniform_(-1e-3, 1e-3, generator=gen)
                continue
            if gen is None:
                gen = torch.Generator(device=param.device).manual_seed(self.seed)
            if "norm" in name:
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, 0.02, generator=gen)
