"""The closing validation pass: mean acceptance length of a drafter on held-out prompts.

Each prompt is decoded greedily with `dflash_mlx.stream_generate`; the
responses carry `cycle_tokens` on the last token of every draft/verify cycle
(the tokens that cycle committed, 1..block size). A prompt's acceptance length
is the mean of those; the reported number is the mean over prompts (spec
section 9's "mean over requests of per-request means").
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from ..generation import stream_generate
from ..stats import RunStats


def acceptance_length(
    model,
    drafter,
    tokenizer,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    block_size: int | None = None,
    console: Console | None = None,
    lookup: bool = True,
) -> dict:
    """{"mean_acceptance_length", "per_prompt", "histogram", "tokens", "seconds", ...}; `lookup=False`: the
    drafter alone (no copy-aware drafting)."""
    per_prompt, totals = [], RunStats()
    tic = time.perf_counter()
    progress = Progress(
        TextColumn("validating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tau]}"),
        TimeRemainingColumn(),
        console=console,
    )
    with progress:
        task = progress.add_task("val", total=len(prompts), tau="")
        for ids in prompts:
            stats = RunStats()
            for r in stream_generate(
                model, drafter, tokenizer, ids, max_tokens=max_tokens, block_size=block_size, lookup=lookup
            ):
                stats.add(r)
            totals.merge(stats)
            if stats.cycles:
                per_prompt.append(stats.acceptance_length)
            mean = sum(per_prompt) / len(per_prompt) if per_prompt else float("nan")
            progress.update(task, advance=1, tau=f"acceptance {mean:.2f}")
    return {
        "mean_acceptance_length": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "prompts": len(prompts),
        "prompts_with_cycles": len(per_prompt),
        "per_prompt": per_prompt,
        "histogram": {str(k): totals.histogram[k] for k in sorted(totals.histogram)},
        "tokens": totals.tokens,
        "seconds": time.perf_counter() - tic,
        "max_tokens": max_tokens,
        "block_size": block_size,
    }
