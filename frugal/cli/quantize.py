"""`frugal quantize`: a checkpoint's layer matrices to INT4 (W4A16, group-wise; round to nearest or
GPTQ) in compressed-tensors' pack-quantized format, or to FP8 e4m3 (per output channel, in
compressed-tensors' float-quantized format, or in 128×128 blocks as DeepSeek / GLM store them),
written as safetensors + config.json."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from frugal.cli.shards import Shards
from frugal.loader import open_checkpoint
from frugal.quant import compressed, fp8
from frugal.quant.int4 import GROUP_SIZES, quantize_rtn

GPTQ_WINDOWS = 32  # calibration windows of 512 tokens
GPTQ_PROMPT_TOKENS = 192  # per built-in prompt, when there is no calibration text at all

# layer matrices that are quantized; embeddings, norms and the LM head are kept
_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_EXPERT = re.compile(r"\.experts\.\d+\.")  # a routed expert's matrix
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up|down)_proj$")  # all of a layer's, stacked
# config.json's ignore entries of an --experts-only checkpoint (compressed-tensors regexes)
_NOT_EXPERTS = ["re:.*self_attn.*", "re:.*shared_experts.*",
                r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def add_quantize_parser(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="write an INT4 (W4A16) or FP8 copy of a checkpoint")
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or a HF directory (default: the bundled model)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--scheme", default="w4a16", choices=["w4a16", "fp8", "w8a16"],
                   help="w4a16: INT4 weights; fp8: FP8 (e4m3) weights, activations quantized "
                        "per token (W8A8); w8a16: FP8 weights, activations kept in the "
                        "model's dtype")
    p.add_argument("--group-size", type=int, default=128, choices=GROUP_SIZES,
                   help="w4a16: inputs per scale")
    p.add_argument("--asymmetric", action="store_true", help="w4a16: zero points per group")
    p.add_argument("--weight-block-size", type=int, default=None,
                   help="fp8, w8a16: one scale per block × block tile (e.g. 128) instead of per "
                        "channel (activations then kept)")
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq"],
                   help="rtn: round to nearest; gptq: error-compensated, calibrated on text")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq: quantize inputs in order of decreasing activation energy, "
                        "groups fixed beforehand (default on for gptq)")
    p.add_argument("--calibration-file", default=None,
                   help="GPTQ calibration text (default: Wikipedia passages of the eval data "
                        "that perplexity is not measured on, else text the model writes)")
    p.add_argument("--device", default="auto", help="where GPTQ runs the model (auto, cpu, cuda)")
    p.add_argument("--experts-only", action="store_true",
                   help="quantize the routed experts of an MoE model only (as Kimi K2 ships "
                        "them: attention, shared experts, dense MLPs and lm_head kept)")
    p.add_argument("--ignore", default="lm_head",
                   help="comma-separated name fragments left unquantized (lm_head is never "
                        "quantized)")
    p.set_defaults(func=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    if args.method != "gptq" and (args.calibration_file or args.act_order is not None):
        raise ValueError("calibration_file, act_order: only with --method gptq")
    int4 = args.scheme == "w4a16"
    if args.method == "gptq" and args.weight_block_size is not None:
        raise ValueError("method: gptq quantizes FP8 per channel (no --weight-block-size)")
    if int4 and args.weight_block_size is not None:
        raise ValueError("weight_block_size: only with --scheme fp8 or w8a16")
    if not int4 and args.asymmetric:
        raise ValueError("asymmetric: only with --scheme w4a16 (FP8 scales are symmetric)")
    if args.weight_block_size is not None and args.weight_block_size < 16:
        raise ValueError(f"weight_block_size: at least 16, got {args.weight_block_size}")
    ckpt = open_checkpoint(args.model)
    out = Path(args.output)
    ignore = [s for s in args.ignore.split(",") if s]
    kept = list(dict.fromkeys(["lm_head", *ignore]))  # (config.json's ignore list, no repeats)
    if args.experts_only:
        kept += _NOT_EXPERTS

    def wanted(name: str) -> bool:
        return (name.endswith(".weight")
                and name.removesuffix(".weight").rsplit(".", 1)[-1] in _MATRICES
                and not any(s in name for s in ignore)
                and (not args.experts_only or _EXPERT.search(name) is not None))

    def check(name: str, w: torch.Tensor) -> None:
        if wanted(name) and int4 and w.shape[1] % args.group_size:
            raise ValueError(f"group_size: {name} has {w.shape[1]} inputs, not a multiple of "
                             f"{args.group_size}")

    if args.method == "gptq":  # (calibrates on the whole model: every matrix in memory)
        if ckpt.config.moe is not None:
            raise ValueError("method: gptq does not calibrate MoE experts; use --method rtn")
        names = list(ckpt.weights())
        for name, w in names:
            check(name, w)
        done = _gptq(args, [(n, w) for n, w in names if wanted(n)], int4)
        weights = iter(names)
    else:  # round to nearest: one input tensor in memory at a time
        if int4 and args.asymmetric and ckpt.config.moe is not None:
            raise ValueError("asymmetric: routed experts load symmetric only (zero point 8, as "
                             "Kimi K2 ships them); drop --asymmetric for a MoE model")
        done, weights = {}, _per_expert(ckpt.weights())
    hf = _hf_config(ckpt)
    shards = Shards(out, Path(args.model) if args.model else None)
    bf16_bytes = quant_bytes = kept_bytes = 0
    errors = []
    try:
        for name, w in tqdm(weights, desc="quantize", unit="tensor", file=sys.stderr):
            check(name, w)
            prefix = name.removesuffix(".weight")
            if not wanted(name):
                shards.add({name: w.contiguous()})
                kept_bytes += w.numel() * w.element_size()
                continue
            if args.method == "gptq":
                q = done[name]
            elif not int4:
                q = fp8.quantize_fp8(w, args.weight_block_size)
            else:
                # (routed experts' scales in bf16, as quant.experts rounds them in memory)
                expert = _EXPERT.search(name) is not None
                q = quantize_rtn(w, args.group_size, symmetric=not args.asymmetric,
                                 scale_dtype=torch.bfloat16 if expert else torch.float32)
            err = (q.dequantize() - w.float()).norm() / w.float().norm()
            errors.append((name, float(err)))
            parts = (compressed.to_tensors(prefix, q, q.scales.dtype) if int4
                     else fp8.to_tensors(prefix, q))
            shards.add(parts)
            bf16_bytes += w.numel() * 2
            quant_bytes += sum(t.numel() * t.element_size() for t in parts.values())
        if not errors:
            raise ValueError("nothing to quantize: no matrix matched (see --ignore, "
                             "--experts-only)")
        shards.close()
    except BaseException:
        shards.remove()
        raise
    hf["quantization_config"] = (
        compressed.quantization_config(args.group_size, not args.asymmetric, kept)
        if int4 else fp8.quantization_config(args.weight_block_size, kept,
                                             w8a8=args.scheme == "fp8"))
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save(out)
    worst = sorted(errors, key=lambda e: -e[1])[:3]
    print("largest relative errors: " + ", ".join(f"{n} {e:.4f}" for n, e in worst))
    total_before = bf16_bytes + kept_bytes
    what = "INT4" if int4 else "FP8"
    print(f"quantized {len(errors)} matrices: {bf16_bytes / 1e6:.1f} MB as bf16 -> "
          f"{quant_bytes / 1e6:.1f} MB {what} ({quant_bytes / bf16_bytes:.3f}x); whole "
          f"checkpoint {total_before / 1e6:.1f} -> {(quant_bytes + kept_bytes) / 1e6:.1f} MB "
          f"(other tensors kept as stored, {kept_bytes / 1e6:.1f} MB); mean relative error "
          f"{sum(e for _, e in errors) / max(len(errors), 1):.4f}")
    print(f"wrote {out}")
    return 0


def _per_expert(weights):
    """(name, tensor) pairs with stacked expert tensors (transformers 5's
    `experts.gate_up_proj` [E, 2I, H], gate rows then up rows, and `experts.down_proj`
    [E, H, I]) split into each expert's matrices under the per-expert names the loader reads
    (`experts.N.gate_proj.weight`, ...); other tensors as they come."""
    for name, w in weights:
        m = _STACKED.match(name)
        if m is None or w.dim() != 3:
            yield name, w
            continue
        prefix, kind = m.groups()
        for e in range(w.shape[0]):
            if kind == "down":
                yield f"{prefix}.{e}.down_proj.weight", w[e]
            else:
                half = w.shape[1] // 2
                yield f"{prefix}.{e}.gate_proj.weight", w[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", w[e, half:]


def _module_of(name: str) -> str:
    """The engine module (fused q|k|v, gate|up) whose inputs feed checkpoint matrix `name`."""
    from frugal.models.llama import LlamaForCausalLM

    prefix = name.removesuffix(".weight")
    head, _, proj = prefix.rpartition(".")
    fused = LlamaForCausalLM.packed_modules.get(proj)
    return f"{head}.{fused[0]}" if fused else prefix


def _gptq(args: argparse.Namespace, matrices: list[tuple[str, torch.Tensor]],
          int4: bool) -> dict:
    """Checkpoint name -> GPTQ-quantized matrix, layer by layer (cli.gptq.sequential) on the
    engine's model run over calibration text."""
    from frugal.cli.gptq import gptq, gptq_fp8, sequential

    llm, calibrate = _calibration(args)
    layers: dict[int, list] = {}
    for name, w in matrices:
        layers.setdefault(int(name.split(".")[2]), []).append((name, w, _module_of(name)))
    act_order = args.act_order is not False

    def quantize(w: torch.Tensor, h: torch.Tensor):
        if int4:
            return gptq(w, h, args.group_size, symmetric=not args.asymmetric,
                        act_order=act_order)
        return gptq_fp8(w, h, act_order=act_order)

    with tqdm(total=len(layers), desc="GPTQ layers", file=sys.stderr) as bar:
        return sequential(llm.engine.runner.model, calibrate, layers, quantize,
                          lambda layer: bar.update(1))


def _calibration(args: argparse.Namespace):
    """An fp32 (CPU) or bf16 engine of the model and calibrate(), which runs the calibration
    text through it once: --calibration-file, else Wikipedia passages of the eval data, else
    text the model writes from the built-in prompts."""
    from frugal import LLM, SamplingParams
    from frugal.worker.kv_scales import PROMPTS

    llm = LLM(args.model, device=args.device, dtype="float32" if args.device == "cpu" else
              "auto", kv_cache_memory="512MiB", enforce_eager=True,
              shared_experts_fusion=False)  # (GPTQ reaches the shared experts by name)
    tok = llm.get_tokenizer()
    text, what = None, None
    if args.calibration_file:
        try:
            with open(args.calibration_file) as f:
                text, what = f.read(), args.calibration_file
        except OSError as e:
            raise ValueError(f"calibration_file: cannot read it ({e})") from e
    elif tok is not None:
        try:
            from frugal.eval.data import calibration_text
            text, what = calibration_text(), "Wikipedia passages (BoolQ test split)"
        except (ValueError, OSError):  # the eval data is not installed
            text = None
    if text is not None and tok is None:
        raise ValueError("calibration_file: the model has no tokenizer")
    if text is not None:
        ids = tok.encode(text)
        chunks = [ids[i:i + 512] for i in range(0, len(ids), 512)][:GPTQ_WINDOWS]
        if not chunks:
            raise ValueError("calibration_file: no text")
        what = f"{len(chunks)} windows of {what} ({sum(map(len, chunks))} tokens)"

        def calibrate() -> None:
            llm.generate(chunks, SamplingParams(max_tokens=1))
    else:  # the same sampled text every pass (seeded)
        params = SamplingParams(max_tokens=GPTQ_PROMPT_TOKENS, temperature=0.8, seed=0,
                                ignore_eos=True)
        what = f"{len(PROMPTS)} built-in prompts and {GPTQ_PROMPT_TOKENS} tokens each"
        if tok is None:  # no tokenizer: prompts of random token ids
            g = torch.Generator().manual_seed(0)
            vocab = llm.engine.model_config.vocab_size
            prompts = torch.randint(vocab, (len(PROMPTS), 24), generator=g).tolist()

        def calibrate() -> None:
            if tok is not None:
                llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
            else:
                llm.generate(prompts, params)
    print(f"GPTQ calibration: {what}, layer by layer", file=sys.stderr)
    return llm, calibrate


def _hf_config(ckpt) -> dict:
    """config.json of the checkpoint's model (HF field names): a HF directory's own (every
    field kept: experts, rope scaling...), else built from the model's shape (a GGUF file)."""
    source = getattr(ckpt, "path", None)
    if source is not None and (Path(source) / "config.json").is_file():
        hf = json.loads((Path(source) / "config.json").read_text())
        hf.pop("quantization_config", None)
        return hf
    c = ckpt.config
    if c.rope_scaling:
        raise ValueError("quantize: checkpoints with rope scaling are not supported yet")
    fields = dataclasses.asdict(c)
    hf = {"architectures": [c.architecture], "model_type": "llama",
          "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
          "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
          "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
          "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
          "max_position_embeddings": c.max_position_embeddings,
          "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": c.hidden_act,
          "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids),
          "torch_dtype": fields.get("dtype", "float32")}
    if c.architecture != "LlamaForCausalLM":
        hf["model_type"] = c.architecture.removesuffix("ForCausalLM").lower()
    return hf
