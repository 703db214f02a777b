"""Instructions per weight of the small-batch MoE GEMV (ops.triton.moe_gemv), counted in the
SASS of its K loop: the kernel compiled for Hopper (sm_90) by Triton's own ptxas, on any
machine, no GPU needed. At one token the INT4 GEMV is bound by instructions, not bytes: an
H200 SM issues 4 warp instructions a clock (128 thread instructions) and its integer units
take half of that, so ~4 instructions a weight cap INT4 near 4 TB/s and ~8 near 2.

    python benchmarks/moe_sass.py [--model qwen3-30b-a3b] [--forms float,fp8,int4]
        [--slots 8] [--tile BLOCK_N,BLOCK_K,num_warps] [--prefetch 0|1|2] [--stages 1-4]
        [--gpu "NVIDIA H200"] [--dump out.sass]

Tiles: --tile (and --prefetch, --stages), else the tuned table's for --gpu, or a GPU of its
capability (ops.triton.moe_configs, with its PREFETCH and STAGES), else the kernel's defaults.
Prints, per form and matrix, the loop's instructions, weights per loop step and thread
instructions per weight, the registers a thread and stack bytes, and the most frequent opcodes.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess

import triton
from moe_layer import model_config
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from frugal.ops.triton import moe, moe_configs, moe_gemv

MODES = {"float": 0, "fp8": 1, "int4": 2, "fp8_w8a8": 3}
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def sass(n: int, k: int, mode: int, gated: bool, tile: tuple, path: str = "gemv",
         block_m: int = 16, options: dict | None = None) -> str:
    """The kernel's SASS for one matrix ([E, (2 if gated) n, k]) on `path` (gemv: moe_gemv;
    sorted: moe's grouped GEMM with BLOCK_M rows), specialized as a launch would be (ints
    equal to 1 are constants, pointers and multiples of 16 aligned). tile: BLOCK_N, BLOCK_K,
    num_warps[, num_stages]; options: the GEMV's PREFETCH and STAGES (moe_gemv.loop_options)."""
    block_n, block_k, warps, *stages = tile
    rows = 2 * n if gated else n
    s_bn, s_bk = {0: (1, 1), 1: (128, 128), 2: (1, 32), 3: (128, 128)}[mode]
    words = k // 8 if mode == 2 else k
    scales = (rows // s_bn) * (k // s_bk) if mode else 1
    ty = {0: "*bf16", 1: "*fp8e4nv", 2: "*i32", 3: "*fp8e4nv"}[mode]
    ints = {"N": n, "K": k, "sam": k, "swe": rows * words, "swn": words, "swk": 1,
            "sse": scales, "ssn": k // s_bk if mode else 1, "ssk": 1, "som": n,
            "magic": moe_gemv.ONE_BITS, "num_slots": 1000, "first": 3, "last": 125,
            "sas": k // 128}
    # (W8A8: blocks of 64 rows or more read codes rounded before, fewer round them: moe._gemm)
    a_fp8 = 0 if mode != 3 else 2 if path == "sorted" and block_m >= 64 else 1
    ptrs = {"a_ptr": "*fp8e4nv" if a_fp8 == 2 else "*bf16", "w_ptr": ty,
            "s_ptr": "*fp32" if mode in (1, 3) else "*bf16",
            "out_ptr": "*bf16", "ids_ptr": "*i32", "route_ptr": "*fp32", "sorted_ptr": "*i32",
            "block_expert_ptr": "*i32", "total_ptr": "*i32", "as_ptr": "*fp32",
            "res_ptr": "*bf16", "dst_ptr": "*bf16", "count_ptr": "*i32"}
    const = {"A_DIV": 8 if gated else 1, "MODE": moe.kernel_mode(mode), "A_FP8": a_fp8,
             "S_BN": s_bn, "S_BK": s_bk,
             "GATED": gated, "BLOCK_N": block_n, "BLOCK_K": block_k}
    if path == "gemv":
        const["FP8_SCALES"] = moe_gemv._fp8_scales(const["MODE"], s_bn, s_bk, n, k, block_n)
        const["PREFETCH"], const["STAGES"] = moe_gemv.loop_options(const["MODE"], options or {})
        const.update(TOP_K=0, RESIDUAL=False)  # (the K loop's count: the epilogue apart)
    if path == "sorted":
        const.update(ROUTED=not gated, F32_DOT=False, BLOCK_M=block_m)
    fn = moe_gemv._gemv if path == "gemv" else moe._sorted_gemm
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const or ints.get(name) == 1:
            signature[name] = "constexpr"
            const.setdefault(name, 1)
            continue
        signature[name] = ptrs.get(name, "i32")
        if name in ptrs or ints[name] % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": warps, **({"num_stages": stages[0]} if stages else {})}
    kernel = triton.compile(ASTSource(fn, signature, const, attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    cubin = pathlib.Path("/tmp/moe_sass.cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    nvdisasm = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    return subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout


def registers() -> str:
    """Registers a thread and spilled bytes of the kernel sass() compiled last."""
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    text = subprocess.run([str(cuobjdump), "--dump-resource-usage", "/tmp/moe_sass.cubin"],
                          capture_output=True, text=True, check=True).stdout
    regs, spill = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return f"{regs.group(1) if regs else '?'} / {spill.group(1) if spill else '?'}"


def k_loop(text: str) -> list[str]:
    """Opcodes of the longest loop (a backward branch to a label)."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"(\.L_x_\d+):", line))}
    best = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [m2.group(1) for x in lines[labels[m.group(1)]:i + 1]
                    if (m2 := INSTRUCTION.match(x))]
            best = max(best, body, key=len)
    return best


def default_tile(path: str, mode: int, k: int, block_m: int) -> tuple:
    """The kernels' own tiles without a table entry (moe_gemv._blocks, moe._blocks)."""
    s_bk = {0: 1, 1: 128, 2: 32, 3: 128}[mode]
    if path == "gemv":
        return (*moe_gemv._blocks(mode, s_bk, k), 4)
    return (*moe._blocks(mode, s_bk, k, block_m), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--forms", default="float,fp8,int4")
    p.add_argument("--slots", type=int, default=8, help="tokens x top_k (picks tuned tiles)")
    p.add_argument("--path", choices=("gemv", "sorted"), default="gemv")
    p.add_argument("--tile", help="BLOCK_N,BLOCK_K,num_warps[,num_stages] for every matrix")
    p.add_argument("--prefetch", type=int, default=None, choices=(0, 1, 2),
                   help="INT4 GEMV: K steps loaded ahead (moe_gemv PREFETCH; default: the "
                        "table entry's, else 0)")
    p.add_argument("--stages", type=int, default=None, choices=(1, 2, 3, 4),
                   help="GEMV: the K loop pipelined in this many stages (moe_gemv STAGES; "
                        "default: the table entry's, else 1)")
    p.add_argument("--gpu", default="NVIDIA H200", help="whose tuned tiles to take")
    p.add_argument("--dump", help="write the last kernel's SASS here")
    args = p.parse_args()
    mc = model_config(args.model)
    arch = moe_configs._table().get(args.gpu, {}).get(moe_configs.CAPABILITY)

    def table_entry(key: str) -> dict | None:  # (as lookup: else a GPU's of its capability)
        return moe_configs.entry(args.gpu, arch, key)

    print("| form | matrix | tile (N, K, warps) | loop instructions | weights a step "
          "| instructions / weight | registers / stack bytes | top opcodes |\n"
          "|---|---|---|---|---|---|---|---|")
    for form in args.forms.split(","):
        mode = MODES[form]
        inter, hidden = mc.moe.intermediate_size, mc.hidden_size
        # (the sorted path's rows a block: gate_up's entry's, for both matrices)
        block_m = moe.rows_per_block(args.slots, mc.moe.num_experts, None if args.tile else
                                     table_entry(moe_configs.key("sorted", mode, inter,
                                                                 hidden, args.slots)))
        for name, n, k, gated in (("gate_up", inter, hidden, True),
                                  ("down", hidden, inter, False)):
            entry = None if args.tile else table_entry(
                moe_configs.key(args.path, mode, n, k, args.slots))
            if entry is not None and args.path == "sorted" and moe.rows_per_block(
                    args.slots, mc.moe.num_experts, entry) != block_m:
                entry = None  # (as moe._gemm drops it)
            if entry is not None and mode == 3 and not moe_configs.w8a8_tile(
                    args.path, entry["BLOCK_K"], entry["BLOCK_N"], block_m):
                entry = None  # (as moe._gemm and moe_gemv._launch drop it)
            if args.tile:
                tile = tuple(int(v) for v in args.tile.split(","))
            else:
                tile = (tuple(entry[f] for f in moe_configs.FIELDS[args.path]) if entry
                        else default_tile(args.path, mode, k, block_m))
            options = {f: v for f, v in (entry or {}).items() if f in ("PREFETCH", "STAGES")}
            options.update({f: v for f, v in (("PREFETCH", args.prefetch),
                                              ("STAGES", args.stages)) if v is not None})
            text = sass(n, k, mode, gated, tile, args.path, block_m, options)
            body = k_loop(text)
            weights = tile[0] * tile[1] * (2 if gated else 1)  # (a loop step's, dequantized once)
            top = collections.Counter(op.split(".")[0] for op in body).most_common(5)
            print(f"| {form} | {name} | {tile} | {len(body)} | {weights} | "
                  f"{len(body) * 32 * tile[2] / weights:.2f} | {registers()} | "
                  f"{', '.join(f'{op} {c}' for op, c in top)} |")
            if args.dump:
                pathlib.Path(args.dump).write_text(text)
    print(f"\n(command: python benchmarks/moe_sass.py --model {args.model} --forms {args.forms}"
          f" --slots {args.slots} --path {args.path} --gpu '{args.gpu}'"
          f"{'' if args.prefetch is None else f' --prefetch {args.prefetch}'}"
          f"{'' if args.stages is None else f' --stages {args.stages}'}"
          f"{' --tile ' + args.tile if args.tile else ''}; BLOCK_M {block_m} on the sorted path, "
          f"the last form's)")


if __name__ == "__main__":
    main()
