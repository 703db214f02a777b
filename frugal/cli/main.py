"""`frugal` command line: serve, serve-pd, generate, chat, eval, bench, calibrate-kv, quantize,
env."""

from __future__ import annotations

import argparse
import logging
import sys

from frugal.cli.env import VersionAction

QUIET = ("httpx2", "httpx")  # the openai client's line per request


def build_parser() -> argparse.ArgumentParser:
    from frugal.bench.offline import add_bench_parser
    from frugal.cli.calibrate import add_calibrate_parser
    from frugal.cli.env import add_env_parser
    from frugal.cli.eval import add_eval_parser
    from frugal.cli.generate import add_chat_parser, add_generate_parser
    from frugal.cli.quantize import add_quantize_parser
    from frugal.cli.serve import add_serve_parser
    from frugal.cli.serve_pd import add_serve_pd_parser

    parser = argparse.ArgumentParser(prog="frugal", description="frugal: LLM inference engine")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_serve_parser(sub)
    add_serve_pd_parser(sub)
    add_generate_parser(sub)
    add_chat_parser(sub)
    add_eval_parser(sub)
    add_bench_parser(sub)
    add_calibrate_parser(sub)
    add_quantize_parser(sub)
    add_env_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for name in QUIET:  # a line per request or per second is noise unless asked for
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return args.func(args)
    except ValueError as e:  # bad input: say what is wrong, no traceback
        print(f"frugal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
