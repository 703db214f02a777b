"""`frugal generate` (one-shot completions) and `frugal chat` (streaming chat in the terminal)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from frugal.cli.args import add_engine_args, add_sampling_args, engine_config, sampling_params
from frugal.engine.llm_engine import LLMEngine
from frugal.llm import LLM
from frugal.request import SamplingParams


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Text pieces of one request as they are produced; aborts it if the consumer stops early."""
    request_id = engine.add_request(prompt, params)
    finished = False
    try:
        while not finished:
            for output in engine.step():
                if output.request_id == request_id:
                    yield output.outputs[0].text
                    finished = output.finished
    finally:
        if not finished:
            engine.abort_request(request_id)


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete prompts (streamed when there is one)")
    add_engine_args(p)
    p.add_argument("-p", "--prompt", action="append", required=True, help="prompt (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_sampling_args(p)
    p.set_defaults(func=run_generate)


def add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with the model in the terminal (streaming)")
    add_engine_args(p)
    p.add_argument("-m", "--message", default=None, help="answer this one message and exit")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p)
    p.set_defaults(func=run_chat)


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad flags fail before the model loads
    llm = LLM.from_config(engine_config(args))
    engine = llm.engine
    prompts = args.prompt
    if args.chat:
        tok = engine.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    if len(prompts) == 1:
        for piece in stream(engine, prompts[0], params):
            print(piece, end="", flush=True)
        print()
        return 0
    for i, out in enumerate(llm.generate(prompts, params)):
        print(f"--- [{i}] finish_reason={out.outputs[0].finish_reason}")
        print(out.outputs[0].text)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    engine = LLMEngine(engine_config(args))
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.message is None
    if interactive:
        print("frugal chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        message = args.message if not interactive else _read("> ")
        if not message:
            return 0
        history.append({"role": "user", "content": message})
        ids = engine.tokenizer.encode_chat(history)
        answer = ""
        for piece in stream(engine, ids, params):
            answer += piece
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": answer})
        if not interactive:
            return 0


def _read(prompt: str) -> str | None:
    try:
        return input(prompt).strip()
    except EOFError:
        return None
