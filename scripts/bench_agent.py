"""Benchmark: an agent-style conversation through `dflash-mlx serve` and `mlx_lm.server`, cold vs cached.

The conversation: a long system prompt (tool descriptions, thousands of
tokens) and four user turns, each request carrying the whole history as
agents send it (system prompt, earlier questions and the server's own earlier
replies). Four servers, started as users start them, on free ports, one after
the other (never two at once), each after one warm-up request:

  dflash cached   dflash-mlx serve (the bundled pair; float32 on a CPU)
  dflash cold     dflash-mlx serve --prompt-cache-size 0 (every prompt prefilled whole)
  mlx-lm cached   python -m mlx_lm.server --model <a float32 copy of the bundled target>
  mlx-lm cold     the same with --prompt-cache-size 0

Per turn, through the official openai client (streamed, greedy): time to
first token, total latency, prompt and cached tokens (usage). Writes JSON
with --out (atomically).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_agent.py --out agent.json
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import openai

from dflash_mlx.models.registry import lookup
from dflash_mlx.utils.io import write_json_atomic

QUESTIONS = [
    "Tom has 3 boxes with 12 apples each. How many apples does he have?",
    "He gives 7 apples to his sister. How many are left?",
    "Then he buys 2 more boxes. How many apples now?",
    "Summarise what happened to Tom's apples in one sentence.",
]
TOOL_NAMES = ["search_files", "read_file", "write_file", "run_tests", "list_directory", "grep", "git_diff",
              "git_commit", "open_url", "ask_user", "create_issue", "run_shell"]  # fmt: skip


def system_prompt(count: int) -> str:
    """`count` tool descriptions as an agent's system prompt lists them (JSON schemas, ~250 tokens each)."""
    tools = []
    for i in range(count):
        name, r = TOOL_NAMES[i % len(TOOL_NAMES)], i // len(TOOL_NAMES)
        parameters = {"type": "object", "required": ["path"], "properties": {
            "path": {"type": "string", "description": "a path relative to the workspace root"},
            "pattern": {"type": "string", "description": "a glob or regular expression"},
            "limit": {"type": "integer", "description": "the most results to return"}}}  # fmt: skip
        description = (f"{name.replace('_', ' ')} in the workspace (variant {r}); returns the result as text "
                       "and never changes files it was not asked to change.")  # fmt: skip
        tools.append({"type": "function", "function": {"name": f"{name}_{r}", "description": description,
                                                        "parameters": parameters}})  # fmt: skip
    return "You are a careful assistant with these tools:\n" + "\n".join(json.dumps(t) for t in tools)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess, ready once `ready` appears on its stderr."""

    def __init__(self, command: list[str], ready: str, url: str | None = None):
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)  # fmt: skip
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stderr] + [lines.put(None)],
                         daemon=True).start()  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = lines.get()
            if line is None:
                raise RuntimeError(f"{command[0]} exited before it was ready")
            if ready in line:
                self.url = url or line.split(" at ")[1].split()[0].removesuffix("/v1")
                return
        raise RuntimeError(f"{command} was not ready in 300 s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def float32_copy(src: Path, dst: Path) -> Path:
    """The bundled target in float32, for mlx_lm.server (bfloat16 matmuls are slow on a CPU)."""
    src = Path(src)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in mx.load(str(src / "model.safetensors")).items()}  # fmt: skip
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def converse(url: str, system: str, max_tokens: int) -> list[dict]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    client.chat.completions.create(model="default_model", max_tokens=4,
                                   messages=[{"role": "user", "content": "Hello"}])  # warm-up  # fmt: skip
    messages, turns = [{"role": "system", "content": system}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        tic, first, text, usage = time.perf_counter(), None, "", None
        stream = client.chat.completions.create(model="default_model", messages=messages, max_tokens=max_tokens,
                                                temperature=0.0, stream=True,
                                                stream_options={"include_usage": True})  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
        done = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None)
        turns.append({"ttft_s": round((first or done) - tic, 3), "latency_s": round(done - tic, 3),
                      "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                      "cached_tokens": getattr(details, "cached_tokens", None), "text": text})  # fmt: skip
        messages.append({"role": "assistant", "content": text})
    client.close()
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tools", type=int, default=6, help="tool descriptions in the system prompt (the bundled "
                    "target's context is 2048 tokens)")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    system = system_prompt(args.tools)
    exe = shutil.which("dflash-mlx")
    with tempfile.TemporaryDirectory() as tmp:
        target = float32_copy(lookup("demo").target_path(), Path(tmp) / "target-f32")
        legs = {
            "dflash cached": ([exe, "serve", "--port", "0"], "serving", None),
            "dflash cold": ([exe, "serve", "--port", "0", "--prompt-cache-size", "0"], "serving", None),
        }
        for name, extra in (("mlx-lm cached", []), ("mlx-lm cold", ["--prompt-cache-size", "0"])):
            port = free_port()
            legs[name] = ([sys.executable, "-m", "mlx_lm.server", "--model", str(target), "--port", str(port),
                           *extra], "Starting httpd", f"http://127.0.0.1:{port}")  # fmt: skip
        report = {"system_prompt_chars": len(system), "max_tokens": args.max_tokens, "legs": {}}
        for name, (command, ready, url) in legs.items():
            server = Server(command, ready, url)
            try:
                turns = converse(server.url, system, args.max_tokens)
            finally:
                server.stop()
            report["legs"][name] = turns
            print(f"{name:14s}", "  ".join(f"ttft {t['ttft_s']:.2f}s total {t['latency_s']:.2f}s "
                                           f"(cached {t['cached_tokens']}/{t['prompt_tokens']})" for t in turns),
                  flush=True)  # fmt: skip
    texts = {name: [t["text"] for t in turns] for name, turns in report["legs"].items()}
    report["dflash_texts_equal"] = texts["dflash cached"] == texts["dflash cold"]
    report["mlx_lm_texts_equal_dflash"] = texts["mlx-lm cold"] == texts["dflash cold"]
    print("dflash cached == cold:", report["dflash_texts_equal"], "  mlx-lm == dflash:",
          report["mlx_lm_texts_equal_dflash"])  # fmt: skip
    if args.out:
        write_json_atomic(args.out, report)


if __name__ == "__main__":
    main()
