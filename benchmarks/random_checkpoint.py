"""Write a checkpoint of random weights (HF layout: config.json + safetensors).

   python benchmarks/random_checkpoint.py DIR [--layers 32]
       Llama-3.1-8B-shaped, BF16, one file per layer, for measuring `frugal quantize` at full
       size without the real weights (the model hub is not reachable from our machines).
       Weights ~ N(0, 0.02²), norms 1; no tokenizer. 16.1 GB at 32 layers.
   python benchmarks/random_checkpoint.py DIR --config .peer/models/deepseek-v2-lite [--device cuda]
       Any architecture transformers builds, at that config's shapes and dtype, under the
       parameter names of its checkpoints (one tensor per expert), tokenizer files copied: every
       floating tensor uniform in [-1e-3, 1e-3] from a seeded generator, as both frugal's and
       vLLM's `--load-format dummy` draw them. Two servers that load it serve the same weights,
       so their MoE routers pick the same experts, which their own dummy weights do not.
   ... --config DIR --layers 24
       The same with the config's first 24 layers only (a checkpoint that fits the disk and
       the GPU beside another server: Qwen3-30B-A3B's 48 layers are 61 GB in bf16, 24 are 31).
   ... --config DIR --router-std 1.0
       The same, with every norm's weight 1, embeddings in ±0.05 (RMS well above a norm's eps)
       and each MoE router drawn so that its logits over the unit-RMS inputs a norm hands it
       spread with that standard deviation (correction bias 0), as a trained router's do: each
       token picks its own experts. With every value in
       ±1e-3 router logits are ~1e-5 apart: a correction bias of ±1e-3 then sends every token to
       the same experts, and so does a softmax rounded to bf16 before its top-k (vLLM's
       DeepSeek-V2 grouped top-k: 1/64 for all 64 experts), where an fp32 softmax does not.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 128256, 32, 8, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("output")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default 32; --config: the config's)")
    p.add_argument("--config", help="a config directory: its architecture and shapes")
    p.add_argument("--device", default="cpu", help="where the weights are drawn (--config)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-std", type=float, default=None,
                   help="(--config) norms 1, routers' logits of this standard deviation")
    a = p.parse_args()
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    if a.config:
        return from_config(Path(a.config), out, a.device, a.seed, a.router_std, a.layers)
    a.layers = a.layers or 32
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": a.layers,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": 8192,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "bos_token_id": 128000, "eos_token_id": 128001}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(HIDDEN, dtype=torch.bfloat16)

    save_file({"model.embed_tokens.weight": rand(VOCAB, HIDDEN),
               "lm_head.weight": rand(VOCAB, HIDDEN), "model.norm.weight": ones()},
              str(out / "model-embed.safetensors"), metadata={"format": "pt"})
    for i in range(a.layers):
        p = f"model.layers.{i}."
        save_file({p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": rand(INTER, HIDDEN),
                   p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
                   p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
                   p + "input_layernorm.weight": ones(),
                   p + "post_attention_layernorm.weight": ones()},
                  str(out / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
        print(f"layer {i + 1}/{a.layers}", flush=True)


@torch.no_grad()
def from_config(config_dir: Path, out: Path, device: str, seed: int,
                router_std: float | None = None, layers: int | None = None) -> None:
    """The --config checkpoint (see the module's docstring); layers: keep the first ones."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir)
    if layers is not None:
        config.num_hidden_layers = layers
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, tensor in model.state_dict().items():  # (a router's correction bias included)
        if not tensor.is_floating_point():
            continue
        if router_std is None:
            tensor.uniform_(-1e-3, 1e-3, generator=gen)
        elif name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith("embed_tokens.weight"):  # (RMS 0.03: norms see it, not their eps)
            tensor.uniform_(-0.05, 0.05, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            tensor.zero_()
        elif name.endswith("mlp.gate.weight"):  # [experts, hidden]: U(±a) has std a / √3
            bound = router_std * (3 / tensor.shape[1]) ** 0.5
            tensor.uniform_(-bound, bound, generator=gen)
        else:
            tensor.uniform_(-1e-3, 1e-3, generator=gen)
    model.save_pretrained(out, max_shard_size="5GB")
    for f in config_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".tiktoken"):
            shutil.copy(f, out / f.name)
    print(f"{sum(t.numel() for t in model.state_dict().values()) / 1e9:.2f} B values -> {out}")


if __name__ == "__main__":
    main()
