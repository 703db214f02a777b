"""`frugal eval`: multiple-choice accuracy and perplexity on the engine's serving path, optionally
paired against a reference configuration (another set of engine flags, saved item scores, or HF
transformers on the same checkpoint)."""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict

from frugal.cli.args import add_engine_args, command_line, engine_config
from frugal.eval import generation
from frugal.eval import multiple_choice as mc
from frugal.eval.data import TASKS, load_task, wiki_text
from frugal.eval.perplexity import PerplexityScore, perplexity, windows
from frugal.llm import LLM


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="accuracy (multiple choice, perplexity, KL divergence)")
    add_engine_args(p)
    g = p.add_argument_group("eval")
    g.add_argument("--tasks", default=None, help=f"comma-separated: {','.join(TASKS)}")
    g.add_argument("--limit", type=int, default=None, help="first N items of each task")
    g.add_argument("--perplexity", choices=["wiki"], default=None,
                   help="perplexity on the Wikipedia passages of BoolQ")
    g.add_argument("--ctx-len", type=int, default=512, help="tokens per perplexity window")
    g.add_argument("--generate", type=int, default=None, metavar="N",
                   help="greedy answers to N chat prompts (8 built-in ones, then questions of "
                        "the four informative tasks) against --reference: identical answers, "
                        "first divergence, and KL teacher-forced on the reference's answers")
    g.add_argument("--generate-tokens", type=int, default=64, help="tokens per answer")
    g.add_argument("--windows", type=int, default=None, help="at most N perplexity windows")
    g.add_argument("--reference", default=None, metavar="FLAGS",
                   help='engine flags of the reference configuration, e.g. "--dtype float32"')
    g.add_argument("--reference-items", default=None, help="reference item scores (--save-items)")
    g.add_argument("--scorer", choices=["engine", "hf"], default="engine",
                   help="hf: score with HF transformers' model of the same checkpoint instead of "
                        "the engine (a reference implementation, for --save-items)")
    g.add_argument("--save-items", default=None, help="write this run's item scores (JSON)")
    g.add_argument("--items", default=None,
                   help="use saved item scores instead of scoring (no model is loaded), e.g. to "
                        "compare two saved runs with --reference-items")
    g.add_argument("--batch", type=int, default=64, help="items per engine call")
    g.add_argument("--output", default=None, help="write all results as JSON")
    p.set_defaults(func=run_eval)


def reference_config(flags: str, model: str | None):
    parser = argparse.ArgumentParser(prog="--reference", add_help=False)
    add_engine_args(parser)
    try:
        ref = parser.parse_args(shlex.split(flags))
    except SystemExit as e:
        raise ValueError(f"reference: cannot parse engine flags {flags!r}") from e
    ref.model = ref.model or model
    return engine_config(ref)


def describe(llm: LLM) -> str:
    runner, worker = llm.engine.runner, llm.engine.worker
    dtype = str(runner.dtype).removeprefix("torch.")
    quant = worker.weights_quantization  # (also a checkpoint's own quantized weights)
    weights = f"{dtype} weights" if quant == "none" else f"{quant} weights, {dtype} activations"
    return f"{weights}, {runner.pool.name} KV, {runner.device}"


def run_eval(args: argparse.Namespace) -> int:
    tasks = [t for t in (args.tasks or "").split(",") if t]
    if not tasks and not args.perplexity and not args.generate:
        raise ValueError("tasks: give --tasks, --perplexity wiki and/or --generate N")
    if args.generate is not None and (args.generate < 1 or args.reference is None):
        raise ValueError("generate: needs N >= 1 and a --reference configuration")
    if args.reference is not None and args.reference_items is not None:
        raise ValueError("reference: give --reference or --reference-items, not both")
    if args.items and (args.perplexity or args.reference or args.scorer != "engine"):
        raise ValueError("items: saved scores only pair with --reference-items")
    data = {t: load_task(t, args.limit) for t in tasks}  # bad task names fail before loading
    llm = reference = None
    if not args.items:
        llm = LLM.from_config(engine_config(args))
    if args.reference is not None:
        reference = LLM.from_config(reference_config(args.reference, args.model))
    config = describe(llm) if llm else f"saved scores {args.items}"
    report = {"command": command_line(), "config": config}
    lines = [f"frugal eval: {config}"
             + (f" vs reference {describe(reference)}" if reference else "")]
    if tasks:
        items = [item for t in tasks for item in data[t].items]
        if args.items:
            wanted = {(i.task, i.index) for i in items}
            scores = [s for s in mc.load_items(args.items) if (s.task, s.index) in wanted]
            if len(scores) != len(items):
                raise ValueError(f"items: {args.items} holds {len(scores)} of the "
                                 f"{len(items)} items asked for")
        elif args.scorer == "hf":
            from frugal.eval.hf_peer import hf_scorer

            runner = llm.engine.runner
            scorer = hf_scorer(args.model, runner.device, runner.dtype)
            scores = mc.score_items(items, llm.get_tokenizer(), scorer, args.batch,
                                    "transformers")
            config = f"transformers, {config}"
        else:
            scores = mc.score_items(items, llm.get_tokenizer(), mc.engine_scorer(llm),
                                    args.batch, "frugal")
        if args.save_items:
            mc.save_items(args.save_items, scores, config)
        ref_scores = None
        if reference is not None:
            ref_scores = mc.score_items(items, llm.get_tokenizer(), mc.engine_scorer(reference),
                                        args.batch, "reference")
        elif args.reference_items:
            ref_scores = mc.load_items(args.reference_items)
        task_table = mc.task_scores(scores)
        report["tasks"] = [asdict(s) | {"num_rows": data[s.task].num_rows,
                                        "num_skipped": data[s.task].num_skipped}
                           for s in task_table]
        lines += ["", "| task | items | skipped | acc % | acc_norm % |", "|---|---|---|---|---|"]
        lines += [f"| {s.task} | {s.num_items} | {data[s.task].num_skipped} | "
                  f"{s.acc:.2f} ± {s.acc_stderr:.2f} | {s.acc_norm:.2f} ± {s.acc_norm_stderr:.2f} |"
                  for s in task_table]
        if ref_scores is not None:
            ref_table = {s.task: s for s in mc.task_scores(
                [r for r in ref_scores if (r.task, r.index) in {(s.task, s.index)
                                                                for s in scores}])}
            paired = mc.paired_scores(scores, ref_scores)
            report["reference_tasks"] = [asdict(s) for s in ref_table.values()]
            report["paired"] = [asdict(p) for p in paired]
            lines += ["", "| task | items | reference acc % | acc % | Δ points [95 % CI] | "
                      "flips (+/−) |", "|---|---|---|---|---|---|"]
            for p in paired:
                ref_acc = f"{ref_table[p.task].acc:.2f}" if p.task in ref_table else "—"
                acc = next((f"{s.acc:.2f}" for s in task_table if s.task == p.task), "—")
                lines.append(f"| {p.task} | {p.num_items} | {ref_acc} | {acc} | {p.diff:+.2f} "
                             f"[{p.ci_low:+.2f}, {p.ci_high:+.2f}] | {p.gained}/{p.lost} |")
    if args.generate:
        prompts = generation.prompts(args.generate)
        tok = llm.get_tokenizer()
        ref_answers = generation.answers(reference, prompts, args.generate_tokens)
        agree = generation.agreement(generation.answers(llm, prompts, args.generate_tokens),
                                     ref_answers, prompts, tok.decode)
        generation.divergence(llm, reference, prompts, ref_answers, agree)
        report["generate"] = asdict(agree)
        lines += ["", *generation.format_agreement(agree, args.generate_tokens)]
    if args.perplexity:
        wins = windows(llm.get_tokenizer().encode(wiki_text()), args.ctx_len, args.windows)
        ppl = perplexity(llm, wins, reference)
        report["perplexity"] = asdict(ppl)
        lines += ["", *format_perplexity(ppl, args.ctx_len)]
    lines += ["", f"command: {report['command']}"]
    print("\n".join(lines))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def format_perplexity(p: PerplexityScore, ctx_len: int) -> list[str]:
    head = f"| windows × {ctx_len} | scored tokens | PPL |"
    row = f"| {p.num_windows} | {p.num_tokens} | {p.ppl:.4f} |"
    if p.ref_ppl is None:
        return [head, "|---|---|---|", row]
    head += " reference PPL | ΔPPL % | KLD mean | KLD p99 | KLD max | top-1 agree % | RMS Δp % |"
    row += (f" {p.ref_ppl:.4f} | {p.ppl_change_pct:+.3f} | {p.kld_mean:.6f} | {p.kld_p99:.6f} "
            f"| {p.kld_max:.4f} | {p.top1_agree_pct:.2f} | {p.rms_dp_pct:.3f} |")
    return [head, "|---|---|---|---|---|---|---|---|---|---|", row]
