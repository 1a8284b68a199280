"""`dflash-mlx bench --backend openai`: progress, the table and the JSON report.

The legs run one after the other (`openai_bench.run_leg`): ``dflash`` on
``--base-url``, then ``baseline`` on ``--baseline-url`` when given. The report
(`--out`, atomic, written only when every leg finished) has one record per
leg (`openai_bench.leg_record`; ``--model`` picks the DFlash server's model,
the baseline's is the first id of its ``/v1/models``), ``speedup`` = dflash throughput / baseline
throughput, and the servers as their ``/v1/models`` entries describe them.
"""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..datasets import sample
from ..utils.io import write_json_atomic
from ..utils.machine import describe
from .common import console, err_console, fail
from .openai_bench import RemoteError, RemoteSettings, api_url, describe_server, leg_record, run_leg


def remote_reasoning(level: str | None) -> dict:
    """`--reasoning` for a server whose template this process cannot read: the common switches."""
    if level is None:
        return {}
    level = level.strip().lower()
    if level in ("on", "off"):
        return {"enable_thinking": level == "on"}
    if level in ("low", "medium", "high", "xhigh"):
        return {"reasoning_effort": level}
    fail(f"--reasoning: expected on, off, low, medium, high or xhigh, got {level!r}.")


def bench_openai(
    base_url: str,
    baseline_url: str | None,
    model: str | None,
    dataset: str,
    num_prompts: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    reasoning: str | None,
    concurrency: int,
    api_key: str,
    timeout_s: float,
    out: Path | None,
) -> None:
    settings = RemoteSettings(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        concurrency=concurrency,
        timeout_s=timeout_s,
        api_key=api_key,
        template_kwargs=remote_reasoning(reasoning),
    )
    conversations = sample(dataset, num_prompts)
    urls = {"dflash": base_url, **({"baseline": baseline_url} if baseline_url else {})}
    try:
        warn = lambda message: err_console.print(f"[yellow]{message}[/]")  # noqa: E731
        servers = {
            name: describe_server(url, model if name == "dflash" else None, settings, warn)
            for name, url in urls.items()
        }  # --model names the DFlash server's model
        records = {}
        for name, url in urls.items():
            served, card = servers[name]
            progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            with progress:
                task = progress.add_task(f"{name} · {api_url(url)}", total=len(conversations))
                leg = run_leg(
                    name,
                    url,
                    served,
                    card,
                    conversations,
                    settings,
                    on_request=lambda done: progress.update(task, completed=done),
                )
            records[name] = leg_record(leg, concurrency)
    except RemoteError as e:
        fail(str(e))
    if "baseline" in records:
        base = records["baseline"]["throughput_tps"]
        records["dflash"]["speedup"] = round(records["dflash"]["throughput_tps"] / base, 4) if base else None
    doc = {
        "backend": "openai",
        "dataset": dataset,
        "num_prompts": len(conversations),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "concurrency": concurrency,
        "legs": records,
        "speedup": records["dflash"].get("speedup"),
        "environment": {"client": describe(), "servers": {name: card for name, (_, card) in servers.items()}},
    }
    _print_table(doc)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, doc)
        console.print(f"[dim]Report written to {out}[/]")


def _print_table(doc: dict) -> None:
    table = Table(
        title=f"{doc['dataset']} · {doc['num_prompts']} prompts · concurrency {doc['concurrency']}", box=box.SIMPLE_HEAD
    )
    for col in ("leg", "server", "tok/s", "speedup", "TTFT p50", "latency p50", "decode tok/s p50", "accept len"):
        table.add_column(col, justify="left" if col in ("leg", "server") else "right", no_wrap=col == "leg")
    for name, rec in doc["legs"].items():
        acc = rec["acceptance_length"]
        speedup = rec.get("speedup")
        table.add_row(
            name,
            rec["url"],
            f"{rec['throughput_tps']:.1f}",
            f"{speedup:.2f}x" if speedup else ("1.00x" if name == "baseline" else "-"),
            f"{rec['ttft_s']['p50']:.2f}s",
            f"{rec['latency_s']['p50']:.2f}s",
            f"{rec['decode_tps']['p50']:.1f}" if rec["decode_tps"]["p50"] is not None else "-",
            f"{acc:.2f}" if acc is not None else "-",
        )
    console.print(table)
    for name, rec in doc["legs"].items():
        if rec["acceptance_length"] is None and name == "dflash":
            err_console.print(
                f"[yellow]{rec['url']} reports no acceptance statistics (no dflash object, no "
                "meta_info.spec_accept_length, no vLLM spec-decode counters on /metrics).[/]"
            )
