"""`dflash-mlx bench`: mlx-lm's decoding vs DFlash on a packaged dataset.

``--backend local`` (the default) runs both in this process
(`cli.benchmark`); ``--backend openai`` sends the same prompts to
OpenAI-compatible servers (`cli.openai_bench`: ``--base-url`` with DFlash,
``--baseline-url`` without). Progress over prompts while it runs, then a rich
table; `--out FILE` writes the JSON report atomically, only once every leg
finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .benchmark import BenchSettings, report, run_benchmark
from ..models.chat_template import reasoning_kwargs
from ..datasets import DATASETS, sample
from ..utils.machine import describe
from ..models.dtype import dtype_name, target_float_dtype
from ..models.resolve import BlockChoice, choose_block_size
from ..utils.io import write_json_atomic
from .common import (
    KV_DEFAULTS,
    DraftOpt,
    KVBitsOpt,
    KVGroupSizeOpt,
    ModelOpt,
    QuantizedKVStartOpt,
    ReasoningOpt,
    ShardOpt,
    console,
    drafter_label,
    fail,
    kv_settings,
    load_models,
    sharding_group,
    user_errors,
)


def bench(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    dataset: Annotated[str, typer.Option("--dataset", "-d", help=f"One of {', '.join(DATASETS)}.")] = "gsm8k",
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=1, help="Prompts (fixed-seed sample).")] = 10,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Tokens per reply.")] = 256,
    block_size: Annotated[
        list[str] | None,
        typer.Option(
            "--block-size",
            "-b",
            metavar="auto|N",
            help="A DFlash leg: auto (adaptive) "
            "or a fixed block; repeat to compare several (default: auto and the "
            "drafter's block).",
        ),
    ] = None,
    temperature: Annotated[float, typer.Option("--temperature", "--temp", min=0.0, help="0: greedy.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**64 - 1, help="Seed for sampled runs.")] = 0,
    baseline: Annotated[
        str, typer.Option("--baseline", help="mlx-lm (plain decoding) or mlx-lm-draft (adds a third leg).")
    ] = "mlx-lm",
    draft_model: Annotated[
        str | None, typer.Option("--draft-model", help="mlx-lm draft model for --baseline mlx-lm-draft.")
    ] = None,
    num_draft_tokens: Annotated[int, typer.Option("--num-draft-tokens", min=1)] = 3,
    reasoning: ReasoningOpt = None,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling (1: off).")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Top-k sampling (0: off).")] = 0,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the JSON report here.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="local (this process) or openai (servers).")] = "local",
    base_url: Annotated[
        str | None, typer.Option("--base-url", help="openai: the DFlash server (with or without /v1).")
    ] = None,
    baseline_url: Annotated[
        str | None, typer.Option("--baseline-url", help="openai: the same model served without speculation.")
    ] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="openai: requests in flight.")] = 1,
    api_key: Annotated[
        str, typer.Option("--api-key", envvar="OPENAI_API_KEY", help="openai: the servers' key.", show_envvar=True)
    ] = "unused",
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=1.0, help="openai: seconds per request.")] = 600.0,
    shard: ShardOpt = None,
    kv_bits: KVBitsOpt = KV_DEFAULTS["kv_bits"],
    kv_group_size: KVGroupSizeOpt = KV_DEFAULTS["kv_group_size"],
    quantized_kv_start: QuantizedKVStartOpt = KV_DEFAULTS["quantized_kv_start"],
    lookup: Annotated[
        str,
        typer.Option(
            "--lookup",
            metavar="on|off|both",
            help="Copy-aware drafting in the DFlash legs (both: each leg with it and without).",
        ),
    ] = "on",
) -> None:
    """Benchmark DFlash against mlx-lm's plain decoding on the same prompts."""
    lookups = {"on": (True,), "off": (False,), "both": (True, False)}.get(lookup)
    if lookups is None:
        fail(f"--lookup: expected on, off or both, got {lookup!r}.")
    if dataset not in DATASETS:
        fail(f"--dataset: expected one of {', '.join(DATASETS)}, got {dataset!r}.")
    if out is not None and out.is_dir():
        fail(f"--out {out}: is a directory; expected a file name.")
    if backend not in ("local", "openai"):
        fail(f"--backend: expected local or openai, got {backend!r}.")
    if backend == "openai":
        if shard is not None:
            fail("--shard is for --backend local (a sharded server is started with `serve --shard tensor`).")
        if draft is not None or block_size or baseline != "mlx-lm" or draft_model is not None:
            fail(
                "--draft, --block-size, --baseline and --draft-model are for --backend local: a server "
                "runs the drafter and blocks it was started with."
            )
        if kv_bits is not None:
            fail("--kv-bits is for --backend local (a server quantizes with `serve --kv-bits`).")
        if lookup != "on":
            fail('--lookup is for --backend local (a request to a server may send "lookup": false).')
        if base_url is None:
            fail("--backend openai needs --base-url URL (the DFlash server).")
        from .bench_openai_cmd import bench_openai

        bench_openai(
            base_url,
            baseline_url,
            model,
            dataset,
            num_prompts,
            max_tokens,
            temperature,
            top_p,
            top_k,
            reasoning,
            concurrency,
            api_key,
            timeout_s,
            out,
        )
        return
    if base_url is not None or baseline_url is not None or concurrency != 1:
        fail("--base-url, --baseline-url and --concurrency are for --backend openai.")
    if baseline not in ("mlx-lm", "mlx-lm-draft"):
        fail(f"--baseline: expected mlx-lm or mlx-lm-draft, got {baseline!r}.")
    if (baseline == "mlx-lm-draft") != (draft_model is not None):
        fail("--baseline mlx-lm-draft and --draft-model PATH go together.")
    group = sharding_group(shard)  # both legs sharded: the baseline is mlx-lm's own sharded decoding
    choice, model_, tokenizer, drafter = load_models(model, draft, group=group)
    kv = kv_settings(model_, kv_bits, kv_group_size, quantized_kv_start)
    with user_errors():
        template_kwargs = reasoning_kwargs(tokenizer, reasoning, choice.entry, choice.label)
        auto = choose_block_size(None, choice.entry, model_, drafter)
        if drafter is None:
            fail("bench needs a drafter: the model has none (pass --draft).")
        blocks = (
            [choose_block_size(b, choice.entry, model_, drafter) for b in block_size]
            if block_size
            else [auto, BlockChoice(auto.size)]
        )
        conversations = sample(dataset, num_prompts)
        assistant = None
        if draft_model is not None:
            from mlx_lm import load as mlx_lm_load

            assistant = mlx_lm_load(draft_model)[0]
    settings = BenchSettings(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        template_kwargs=template_kwargs,
        num_draft_tokens=num_draft_tokens,
        kv=kv,
    )
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[leg]}"),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task(f"{dataset} (warm-up)", total=len(conversations), leg="")

        def on_prompt(i: int, leg: str) -> None:
            progress.update(task, completed=i, description=dataset, leg=leg)

        legs = run_benchmark(
            model_,
            tokenizer,
            drafter,
            conversations,
            blocks,
            settings,
            draft_model=assistant,
            on_prompt=on_prompt,
            lookups=lookups,
        )
        progress.update(task, completed=len(conversations))
    dtype = dtype_name(target_float_dtype(model_))
    environment = describe(dtype=dtype) | ({"tensor_ranks": group.size()} if group is not None else {})
    doc = report(
        legs,
        environment,
        {
            "model": choice.label,
            "target": choice.target,
            "draft": choice.draft,
            "dataset": dataset,
            "num_prompts": len(conversations),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "baseline": "mlx_lm.stream_generate",
            "backend": "local",
            "drafter_kind": drafter_label(drafter),
        }
        | kv,
    )
    _print_table(doc, legs)
    if out is not None and (group is None or group.rank() == 0):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, doc)
        console.print(f"[dim]Report written to {out}[/]")


def _print_table(doc: dict, legs) -> None:
    env = doc["environment"]
    title = f"{doc['model']} · {doc['dataset']} · {doc['num_prompts']} prompts · {env['chip']} ({env['device']})"
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("leg", "tok/s", "speedup", "tokens/cycle", "same text as baseline"):
        table.add_column(col, justify="left" if col == "leg" else "right")
    table.add_row("mlx-lm (baseline)", f"{doc['baseline_tps']:.1f}", "1.00x", "-", "-")
    for run in doc["runs"]:
        acc = run["acceptance_length"]
        kind = doc.get("drafter_kind", "DFlash")
        name = f"{kind} b={run['block_size']}"
        if run["block_size"] == "auto":
            name = f"{kind} auto (≤{run['max_block_size']}, mean {run['mean_block_size'] or 0:.1f})"
        name += "" if run["lookup"] else ", lookup off"
        table.add_row(
            name,
            f"{run['dflash_tps']:.1f}",
            f"{run['speedup']:.2f}x",
            f"{acc:.2f}" if acc is not None else "-",
            "yes" if run["greedy_matches"] else "no",
        )
    if "mlx_lm_draft" in doc:
        d = doc["mlx_lm_draft"]
        table.add_row(
            "mlx-lm draft model", f"{d['tps']:.1f}", f"{d['speedup']:.2f}x", "-", "yes" if d["greedy_matches"] else "no"
        )
    console.print(table)
    for run in doc["runs"]:
        tokens = "  ".join(f"{k}:{v}" for k, v in run["histogram"].items())
        blocks = "  ".join(f"{k}:{v}" for k, v in run["block_sizes"].items())
        sources = "  ".join(f"{k}:{v}" for k, v in run["sources"].items())
        console.print(
            f"[dim]b={run['block_size']}{'' if run['lookup'] else ' lookup off'}: tokens per cycle "
            f"{tokens} · blocks {blocks} · tokens from {sources}[/]"
        )
    if doc["temperature"] == 0 and not all(r["greedy_matches"] for r in doc["runs"]):
        console.print(
            "[yellow]Some greedy DFlash replies differ from the baseline's (see the JSON "
            "'prompts'): near-tie logits in low precision can flip a token.[/]"
        )
