"""Which FP8 KV scheme keeps greedy answers on track? Fake-quantized K/V, measured as agreement.

Runs the default model on the CPU in fp32 with an fp32 KV cache, and quantizes each K and V to
float8 e4m3 and back as it is stored, under one scheme at a time; then compares the greedy
answers to chat prompts from the eval data with those of the unquantized cache (frugal eval
--generate's measure: identical answers, mean first divergence). Only the rounding is simulated:
the numbers are those an FP8 cache with that scheme would give, whatever its kernels.
Schemes: bf16 (reference point), static (one scale per layer, KV head and K/V, calibrated at
start-up: what --kv-cache-dtype fp8 stores), token_head (a scale per token and KV head, from
its own amax), k_only / v_only (static, the other left unquantized), sink4 (static, the first 4
positions unquantized), hadamard_k (K rotated by a Hadamard matrix along head_dim, then
token_head; V token_head), int8_token_head (int8 with a scale per token and head, for contrast).
   python benchmarks/kv_fp8_schemes.py --prompts 200 --tokens 64 --schemes bf16,static,token_head
"""

from __future__ import annotations

import argparse

import torch

import frugal.ops.torch_ref as torch_ref
import frugal.ops.torch_ref.attention as attention
from frugal import LLM
from frugal.eval import generation

FP8 = torch.float8_e4m3fn


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def per_token_head(x: torch.Tensor, top: float) -> torch.Tensor:
    return (x.abs().amax(dim=2, keepdim=True) / top).clamp(min=1e-8)


class Scheme:
    """Patches the CPU store so that K/V go through `name`'s rounding before they are stored."""

    def __init__(self, name: str, static: torch.Tensor, layer_of: dict[int, int]) -> None:
        self.name, self.static, self.layer_of = name, static, layer_of
        self.positions: torch.Tensor | None = None

    def round(self, x: torch.Tensor, layer: int, row: int) -> torch.Tensor:
        static = self.static[layer, row][None, :, None]
        n = self.name
        if n == "bf16":
            return x.to(torch.bfloat16).float()
        if n == "static":
            return fake_fp8(x, static)
        if n == "token_head":
            return fake_fp8(x, per_token_head(x, 448))
        if n in ("k_only", "v_only"):
            return fake_fp8(x, static) if row == (0 if n == "k_only" else 1) else x
        if n == "sink4":
            return torch.where((self.positions < 4)[:, None, None], x, fake_fp8(x, static))
        if n == "hadamard_k":
            if row == 1:
                return fake_fp8(x, per_token_head(x, 448))
            h = hadamard(x.shape[-1])
            xr = x @ h
            return fake_fp8(xr, per_token_head(xr, 448)) @ h.T
        if n == "int8_token_head":
            s = per_token_head(x, 127)
            return (x / s).round().clamp(-127, 127) * s
        raise ValueError(f"schemes: unknown scheme {n!r}")

    def __enter__(self):
        store, rotary = attention.store_kv, attention.rotary_store_kv

        def store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
            layer = self.layer_of[id(k_cache)]
            store(self.round(k.float(), layer, 0), self.round(v.float(), layer, 1), k_cache,
                  v_cache, slot_mapping, None)

        def rotary_store_kv(q, k, v, positions, *args, **kwargs):
            self.positions = positions
            return rotary(q, k, v, positions, *args, **kwargs)

        self._saved = store, rotary
        attention.store_kv, attention.rotary_store_kv = store_kv, rotary_store_kv
        torch_ref.rotary_store_kv = rotary_store_kv
        return self

    def __exit__(self, *exc) -> None:
        attention.store_kv, attention.rotary_store_kv = self._saved
        torch_ref.rotary_store_kv = self._saved[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--schemes", default="bf16,static,token_head,k_only,v_only,sink4,hadamard_k,"
                                        "int8_token_head")
    a = p.parse_args()
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="1GiB")
    static = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB",
                 kv_cache_dtype="fp8").engine.runner.pool.scales
    layer_of = {id(k): i for i, k in enumerate(llm.engine.runner.pool.k)}
    prompts = generation.questions(a.prompts)
    reference = generation.answers(llm, prompts, a.tokens)
    decode = llm.get_tokenizer().decode
    print(f"{a.prompts} chat prompts, greedy, {a.tokens} tokens, default model, fp32 on the CPU; "
          "against the unquantized (fp32) cache")
    print("| scheme | identical answers | mean first divergence | first answer |")
    print("|---|---|---|---|")
    for name in a.schemes.split(","):
        with Scheme(name, static, layer_of):
            ours = generation.answers(llm, prompts, a.tokens)
            capital = generation.answers(llm, ["What is the capital of France?"], 16)[0]
        agree = generation.agreement(ours, reference, prompts, decode)
        print(f"| {name} | {agree.num_identical} | {agree.mean_first_divergence:.1f} | "
              f"{decode(capital)!r} |", flush=True)
    print(f"command: python benchmarks/kv_fp8_schemes.py --prompts {a.prompts} --tokens "
          f"{a.tokens} --schemes {a.schemes}")


if __name__ == "__main__":
    main()
