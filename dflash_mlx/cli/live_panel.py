"""The live view of a reply: streamed text above a panel of speed and acceptance.

`reply_view` renders the text so far plus a panel with tok/s, mean tokens per
cycle and the acceptance histogram (cycles that committed 1..block size
tokens), the tokens from each source (lookup, drafter, target), and for an
adaptive block the blocks it chose; `LiveReply` is the
renderable rich's `Live` redraws while tokens arrive (built at each redraw,
not per token). `summary_line` is the one line printed after each
turn.
"""

from __future__ import annotations

import threading

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..stats import RunStats

BAR_WIDTH = 30


def histogram_table(stats: RunStats) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(justify="right", style="bold")
    table.add_column()
    table.add_column(justify="right", style="dim")
    counts = stats.histogram_dict()
    top = max(counts.values(), default=0)
    for size, count in counts.items():
        width = round(BAR_WIDTH * count / top) if top else 0
        table.add_row(size, Text("█" * width or "·", style="cyan"), str(count))
    return table


def stats_title(stats: RunStats) -> str:
    parts = [f"{stats.tps:.1f} tok/s", f"{stats.tokens} tokens"]
    if stats.acceptance_length is not None:
        parts.append(f"{stats.acceptance_length:.2f} tokens/cycle")
    if stats.block_size and stats.adaptive:
        mean = stats.mean_block_size
        parts.append(f"block auto ≤{stats.block_size}" + (f", mean {mean:.1f}" if mean is not None else ""))
    elif stats.block_size:
        parts.append(f"block {stats.block_size}")
    return " · ".join(parts)


def blocks_line(stats: RunStats) -> Text:
    """The blocks an adaptive run chose: `block:cycles` pairs."""
    chosen = "  ".join(f"{k}:{v}" for k, v in stats.blocks_dict().items()) or "-"
    return Text(f"blocks chosen  {chosen}", style="dim")


def sources_text(stats: RunStats) -> Text:
    """Tokens per source: `source:tokens` pairs."""
    counts = "  ".join(f"{k}:{v}" for k, v in stats.sources_dict().items()) or "-"
    return Text(f"tokens from    {counts}", style="dim")


def stats_panel(stats: RunStats) -> Panel:
    if not stats.block_size:
        body = Text("plain decoding (no drafter)", style="dim")
    elif stats.adaptive:
        body = Group(histogram_table(stats), blocks_line(stats), sources_text(stats))
    else:
        body = Group(histogram_table(stats), sources_text(stats))
    return Panel(
        body,
        title=stats_title(stats),
        title_align="left",
        subtitle="tokens per cycle",
        subtitle_align="left",
        border_style="blue",
        expand=False,
    )


def reply_view(text: str, stats: RunStats) -> Group:
    return Group(Text(text), stats_panel(stats))


class LiveReply:
    """The view of a reply still arriving: tokens only append to it (`add`, under `lock`); the text
    and the panel are built when `Live` redraws from its own thread (a few times a second), not
    once per token, from what the lock guards."""

    def __init__(self, stats: RunStats, pieces: list[str]):
        self.stats, self.pieces = stats, pieces
        self.lock = threading.Lock()

    def add(self, response) -> None:
        with self.lock:
            self.stats.add(response)
            self.pieces.append(response.text)

    def __rich__(self) -> Group:
        with self.lock:
            return reply_view("".join(self.pieces), self.stats)


def summary_line(stats: RunStats) -> str:
    accept = f", mean acceptance {stats.acceptance_length:.2f}" if stats.acceptance_length is not None else ""
    if stats.block_size and stats.sources_line():
        accept += f" ({stats.sources_line()})"
    if stats.adaptive and stats.mean_block_size is not None:
        accept += f", mean block {stats.mean_block_size:.1f}"
    return f"{stats.tokens} tokens, {stats.tps:.1f} tok/s{accept}, peak memory {stats.peak_memory_gb:.2f} GB"
