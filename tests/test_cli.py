"""The `frugal` command as a user runs it (subprocesses on the real default model)."""

import subprocess
import sys


def frugal(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frugal.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, input=stdin)


def test_help_lists_subcommands():
    r = frugal("--help")
    assert r.returncode == 0
    for command in ("generate", "chat", "bench"):
        assert command in r.stdout


def test_env_and_version_print_the_versions_and_the_gpu():
    import torch

    for args in (("env",), ("--version",)):
        r = frugal(*args)
        assert r.returncode == 0, r.stderr
        assert f"torch {torch.__version__}" in r.stdout and "triton " in r.stdout
        assert "GPU: " in r.stdout and "tested on the GPU: torch 2.11.0" in r.stdout


def test_chat_answers_the_readme_question():
    r = frugal("chat", "--message", "What is the capital of France?", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "KV cache:" in r.stderr and "tokens" in r.stderr  # capacity logged at start-up


def test_interactive_chat_keeps_history_and_quits_on_empty_line():
    r = frugal("chat", "--temperature", "0", "--max-tokens", "24", "--log-level", "WARNING",
               stdin="What is the capital of France?\nAnd of Germany?\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 3  # two questions, then the empty line that quits
    assert "Paris" in r.stdout


def test_generate_streams_one_prompt():
    r = frugal("generate", "-p", "The capital of France is", "--temperature", "0",
               "--max-tokens", "8", "--log-level", "WARNING")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_input_is_a_clear_error():
    r = frugal("generate", "/no/such/model.gguf", "-p", "hi")
    assert r.returncode == 2 and "/no/such/model.gguf does not exist" in r.stderr
    assert "Traceback" not in r.stderr
    r = frugal("generate", "-p", "hi", "--temperature", "-1")
    assert r.returncode == 2 and "temperature" in r.stderr


def test_bench_offline_prints_a_table():
    r = frugal("bench", "offline", "--concurrency", "1,2", "--input-len", "8", "--output-len", "4",
               "--log-level", "WARNING")
    assert r.returncode == 0, r.stderr
    assert "| frugal | 2 |" in r.stdout and "command: frugal bench offline" in r.stdout


def test_eval_generate_against_a_reference(tmp_path):
    out = tmp_path / "out.json"
    r = frugal("eval", "--generate", "2", "--generate-tokens", "8", "--kv-cache-dtype", "fp8",
               "--reference", "--dtype float32", "--output", str(out), "--log-level", "WARNING")
    assert r.returncode == 0, r.stderr
    assert "| 2 | 8 |" in r.stdout and "identical answers" in r.stdout
    import json

    report = json.loads(out.read_text())["generate"]
    assert report["num_prompts"] == 2 and len(report["first_divergence"]) == 2
    assert frugal("eval", "--generate", "2").returncode == 2  # needs a reference


def test_eval_small_run_with_saved_reference(tmp_path):
    items, out = tmp_path / "items.json", tmp_path / "out.json"
    r = frugal("eval", "--tasks", "piqa,boolq", "--limit", "4", "--perplexity", "wiki",
               "--ctx-len", "64", "--windows", "1", "--save-items", str(items), "--output",
               str(out), "--log-level", "WARNING")
    assert r.returncode == 0, r.stderr
    assert "| piqa | 4 | 0 |" in r.stdout and "| boolq | 4 | 0 |" in r.stdout
    import json

    report = json.loads(out.read_text())
    assert [t["task"] for t in report["tasks"]] == ["piqa", "boolq"]
    assert report["tasks"][1]["num_rows"] == 3270 and report["perplexity"]["num_tokens"] == 63
    again = frugal("eval", "--tasks", "piqa,boolq", "--limit", "4", "--reference-items",
                   str(items), "--log-level", "WARNING")
    assert again.returncode == 0, again.stderr
    assert "| all | 8 |" in again.stdout and "+0.00 [+0.00, +0.00] | 0/0 |" in again.stdout
    offline = frugal("eval", "--tasks", "piqa", "--limit", "4", "--items", str(items),
                     "--reference-items", str(items))  # saved scores only: no model
    assert offline.returncode == 0 and "| piqa | 4 |" in offline.stdout
    assert "loaded" not in offline.stderr
    bad = frugal("eval", "--tasks", "hellaswag")
    assert bad.returncode == 2 and "hellaswag" in bad.stderr
