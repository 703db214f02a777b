"""Command-line flags shared by every subcommand (vLLM names where vLLM has one)."""

from __future__ import annotations

import argparse
import shlex
import sys

from frugal.config import DUMMY_INITS, CacheConfig, EngineConfig, SchedulerConfig
from frugal.request import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a .gguf file, a HF model directory, or a dummy preset "
                             "(default: the bundled SmolLM2-135M-Instruct GGUF)")
    g = parser.add_argument_group("engine")
    g.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors",
                                                             "dummy"])
    g.add_argument("--dummy-init", default="uniform", choices=DUMMY_INITS,
                   help="dummy weights: uniform in ±1e-3 as vLLM's (MoE tokens routed as "
                        "vLLM routes them), or N(0, 0.02²) with norm weights 1")
    g.add_argument("--dtype", default="auto", help="auto (fp32 on CPU), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--quantization", default="none", choices=["none", "int4", "fp8"],
                   help="layer weights: int4 = W4A16 group-wise, fp8 = e4m3 per output "
                        "channel, activations per token (W8A8); weights the checkpoint "
                        "stores quantized (a GGUF's Q4_0/Q4_1, compressed-tensors, FP8 block "
                        "scales) are kept as they are, others rounded to nearest")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across this many processes (GPUs: cuda:0..N-1; CPU: "
                        "Gloo)")
    g.add_argument("--num-layers", type=int, default=None,
                   help="run only the model's first N decoder layers (a model too large for "
                        "one GPU at its real per-layer shapes; for benchmarks)")
    g.add_argument("--ops-backend", default="auto", choices=["auto", "torch_ref", "triton"],
                   help="kernels: auto = triton on CUDA, torch_ref (plain PyTorch) on CPU")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool budget: bytes (4GiB, 512MiB) or a fraction of free memory "
                        "(default: from --gpu-memory-utilization on a GPU, 2GiB on the CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights, activations, graphs and KV")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="wait for each step's tokens before launching the next step")
    g.add_argument("--cuda-graph-max-bs", type=int, default=256,
                   help="largest decode batch run from a CUDA graph")
    g.add_argument("--prompt-graph-max-tokens", type=int, default=2048,
                   help="steps with prompt tokens of up to this many tokens run from CUDA "
                        "graphs too (0: none; with decode graphs, MHA and MLA models, not "
                        "GLM-5's sparse attention)")
    g.add_argument("--disable-shared-experts-fusion", action="store_true",
                   help="keep an MoE model's shared experts apart from its routed ones (by "
                        "default they join them where their sizes allow: one MoE kernel a "
                        "layer for both)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the activation dtype), bfloat16, float16, float32; 8-bit: "
                        "fp8_e4m3 (alias fp8: scaled per layer and KV head, calibrated), "
                        "fp8_per_token_head and int8_per_token_head (alias int8_per_token: a "
                        "scale per token and head, stored in the page), fp8_v (K in the "
                        "activation dtype, V as fp8_per_token_head)")
    g.add_argument("--kv-cache-max-kl", type=float, default=None,
                   help="refuse to start when the quantized KV cache moves the next-token "
                        "distribution of built-in texts by more than this mean KL (the "
                        "start-up check logs it)")
    g.add_argument("--kv-cache-check", default="on", choices=["on", "off"],
                   help="the start-up check of a quantized KV cache (off: skip it, for a "
                        "model and format measured already)")
    g.add_argument("--kv-scales-path", default=None,
                   help="FP8 KV scales from `frugal calibrate-kv` (default: the checkpoint's, "
                        "else calibrated at start-up)")
    g.add_argument("--calibration-file", default=None,
                   help="text to calibrate FP8 KV scales on at start-up (default: text the "
                        "model writes from built-in prompts)")
    g.add_argument("--kv-integrity", default="on", choices=["on", "off"],
                   help="check before every step that each request's KV pages are still its "
                        "own (per-page tags); a request that fails is aborted alone")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="share the KV of full pages between requests that start with the same "
                        "tokens (on by default; --no-enable-prefix-caching turns it off)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (prefill chunks + decodes; default 8192 on "
                        "a GPU of 70 GiB or more, else 2048, as vLLM's server)")
    g.add_argument("--max-model-len", type=int, default=None)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, load_format=args.load_format, dummy_init=args.dummy_init,
        dtype=args.dtype, device=args.device,
        ops_backend=args.ops_backend, seed=args.seed, enforce_eager=args.enforce_eager,
        quantization=args.quantization, num_layers=args.num_layers,
        tensor_parallel_size=args.tensor_parallel_size,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        prompt_graph_max_tokens=args.prompt_graph_max_tokens,
        shared_experts_fusion=not args.disable_shared_experts_fusion,
        overlap_schedule=not args.disable_overlap_schedule,
        cache=CacheConfig(page_size=args.page_size, kv_cache_memory=args.kv_cache_memory,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_dtype=args.kv_cache_dtype,
                          kv_scales_path=args.kv_scales_path,
                          calibration_file=args.calibration_file,
                          kv_cache_max_kl=args.kv_cache_max_kl,
                          kv_cache_check=args.kv_cache_check == "on",
                          kv_integrity=args.kv_integrity == "on",
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len))


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                          stop=args.stop, ignore_eos=args.ignore_eos)


def command_line() -> str:
    """The command as the user typed it, printed beside every result so it can be rerun."""
    return "frugal " + shlex.join(sys.argv[1:])
