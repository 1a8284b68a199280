"""`dflash-mlx chat`: an interactive multi-turn session.

Each turn renders the whole history with the model's chat template and hands
it to one `Session`, which keeps the target and drafter caches: only what the
previous turn did not already feed is prefilled (hybrid targets included).
Tokens stream into a rich `Live` view with a panel of speed and acceptance;
Ctrl-C stops a reply (its text so far stays in the history) and keeps the
session. In-chat commands are listed in `HELP`.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated

import typer
from rich.live import Live
from rich.markup import escape

from ..models.chat_template import reasoning_kwargs, render, template_source
from ..generation import encode_prompt, stream_generate
from ..models.block_size import widest_block
from ..models.dtype import dtype_name, target_float_dtype
from ..models.resolve import BlockChoice, choose_block_size
from ..session import make_session
from ..stats import RunStats
from .common import (
    BlockOpt,
    DraftOpt,
    KVBitsOpt,
    KVGroupSizeOpt,
    LookupOpt,
    ModelOpt,
    QuantizedKVStartOpt,
    ReasoningOpt,
    SeedOpt,
    ShardOpt,
    SystemOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
)
from .common import (
    KV_DEFAULTS,
    console,
    drafter_label,
    fail,
    kv_settings,
    load_models,
    lookup_flag,
    sharding_group,
    user_errors,
)
from .live_panel import LiveReply, stats_panel, summary_line

HELP = """[bold]Commands[/]
  /reset        forget the conversation (keeps the system prompt)
  /stats        statistics of this session so far
  /block N      fix the draft/verify block size (anchor included); /block auto: adaptive
  /temp T       sampling temperature (0: greedy)
  /system TEXT  set the system prompt (empty: none)
  /help         this list
  /quit         leave (also Ctrl-D)
Ctrl-C stops the current reply and keeps the session."""


@dataclass
class ChatState:
    system: str | None
    temperature: float
    block: BlockChoice
    largest: int | None = None  # the adaptive block's maximum (/block auto)
    widest: int | None = None  # the drafter's own block: the widest /block N
    messages: list[dict] = field(default_factory=list)
    totals: RunStats = field(default_factory=RunStats)

    def conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages


def chat(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per reply (-1: no limit).")] = 1024,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    block_size: BlockOpt = None,
    system: SystemOpt = None,
    reasoning: ReasoningOpt = None,
    no_dflash: Annotated[bool, typer.Option("--no-dflash", help="Plain target decoding, for comparison.")] = False,
    seed: SeedOpt = None,
    shard: ShardOpt = None,
    kv_bits: KVBitsOpt = KV_DEFAULTS["kv_bits"],
    kv_group_size: KVGroupSizeOpt = KV_DEFAULTS["kv_group_size"],
    quantized_kv_start: QuantizedKVStartOpt = KV_DEFAULTS["quantized_kv_start"],
    lookup: LookupOpt = "on",
) -> None:
    """Chat with a model; replies stream with a live acceptance histogram."""
    use_lookup = lookup_flag(lookup)
    if max_tokens == 0 or max_tokens < -1:
        fail("--max-tokens: expected a positive integer (or -1 for no limit).")
    group = sharding_group(shard)  # (every rank reads the same stdin: mlx.launch sends it to all)
    choice, model_, tokenizer, drafter = load_models(model, draft, use_draft=not no_dflash, group=group)
    kv = kv_settings(model_, kv_bits, kv_group_size, quantized_kv_start)
    with user_errors():
        if template_source(tokenizer) is None:
            fail(f"{choice.label} has no chat template; use `dflash-mlx generate --raw` instead.")
        template_kwargs = reasoning_kwargs(tokenizer, reasoning, choice.entry, choice.label)
        b = choose_block_size(block_size, choice.entry, model_, drafter)
    largest = choose_block_size(None, choice.entry, model_, drafter).size
    state = ChatState(
        system=system,
        temperature=temperature,
        block=b,
        largest=largest,
        widest=widest_block(drafter) if drafter is not None else None,
    )
    state.totals.block_size, state.totals.adaptive = b.size, b.adaptive
    session = make_session(model_, drafter)
    mode = f"{drafter_label(drafter)}, {b.label}" if drafter is not None else "plain decoding"
    mode += f", {dtype_name(target_float_dtype(model_))}"
    console.print(f"[bold]{escape(choice.label)}[/] ({mode}). /help for commands, /quit to leave.")
    while True:
        try:
            line = console.input("[bold green]you>[/] ")
        except EOFError:
            console.print()
            break
        except KeyboardInterrupt:
            console.print("\n[dim](Ctrl-C: /quit or Ctrl-D to leave)[/]")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if _command(line, state, session, drafter is not None):
                break
            continue
        state.messages.append({"role": "user", "content": line})
        reply = ""
        try:
            prompt = encode_prompt(tokenizer, render(tokenizer, state.conversation(), template_kwargs))
            reply = _reply(
                model_,
                drafter,
                tokenizer,
                prompt,
                session,
                state,
                dict(max_tokens=max_tokens, top_p=top_p, top_k=top_k, seed=seed, lookup=use_lookup, **kv),
            )
        except KeyboardInterrupt:  # outside the token loop (which turns Ctrl-C into a flag)
            console.print("\n[yellow](reply interrupted)[/]")
        state.messages.append({"role": "assistant", "content": reply})
    raise typer.Exit(0)


def _reply(model, drafter, tokenizer, prompt, session, state: ChatState, options: dict) -> str:
    stats = RunStats(block_size=state.block.size, adaptive=state.block.adaptive)
    pieces: list[str] = []
    stream = stream_generate(
        model,
        drafter,
        tokenizer,
        prompt,
        **state.block.generation_kwargs(),
        temperature=state.temperature,
        session=session,
        **options,
    )
    with _ctrl_c_sets_flag() as interrupted:
        console.print("[bold blue]assistant>[/]")
        stats.begin()
        _stream_into_live(stream, stats, pieces, interrupted)
    if interrupted:
        console.print("[yellow](reply interrupted)[/]")
    state.totals.merge(stats)
    reused = f", prompt {stats.prompt_tokens} tokens ({session.reused} cached)" if stats.prompt_tokens else ""
    console.print(f"[dim]{summary_line(stats)}{reused}[/]")
    return "".join(pieces)


@contextmanager
def _ctrl_c_sets_flag():
    """While replying, Ctrl-C only raises a flag that the token loop checks.

    A KeyboardInterrupt could land anywhere inside the engine, between a
    rollback and its bookkeeping; a flag stops it between two tokens instead.
    """
    flag: list[bool] = []

    def handler(signum, frame):
        flag.append(True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _stream_into_live(stream, stats: RunStats, pieces: list[str], interrupted: list) -> None:
    view = LiveReply(stats, pieces)
    with Live(view, console=console, refresh_per_second=8, vertical_overflow="visible") as live:
        for response in stream:
            view.add(response)
            if interrupted:
                break
        stream.close()  # after a break: undoes the queued verify, so the caches stay usable
        live.refresh()  # the last tokens, whatever the redraw rate


def _command(line: str, state: ChatState, session, has_drafter: bool) -> bool:
    """Run an in-chat command; True means leave."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit", "/q"):
        return True
    if name == "/help":
        console.print(HELP)
    elif name == "/reset":
        state.messages.clear()
        session.reset()
        console.print("[dim]Conversation cleared.[/]")
    elif name == "/stats":
        console.print(stats_panel(state.totals))
        console.print(f"[dim]session: {summary_line(state.totals)}[/]")
    elif name == "/block":
        if not has_drafter:
            console.print("[red]/block needs a drafter (this chat runs with --no-dflash).[/]")
        elif arg.lower() == "auto":
            state.block = BlockChoice(state.largest, adaptive=True)
            state.totals.block_size, state.totals.adaptive = state.largest, True
            console.print(f"[dim]Adaptive block, at most {state.largest}.[/]")
        elif not arg.isdigit() or not 1 <= int(arg) <= state.widest:
            console.print(
                f"[red]/block: expected auto or an integer from 1 to {state.widest} (the drafter's block), "
                f"got {escape(arg or 'nothing')}.[/]"
            )
        else:
            state.block = BlockChoice(int(arg))
            state.totals.block_size, state.totals.adaptive = int(arg), False
            console.print(f"[dim]Block size {int(arg)}.[/]")
    elif name == "/temp":
        try:
            value = float(arg)
            if value < 0:
                raise ValueError
        except ValueError:
            console.print(f"[red]/temp: expected a number >= 0, got {escape(arg or 'nothing')}.[/]")
        else:
            state.temperature = value
            console.print(f"[dim]Temperature {value:g}.[/]")
    elif name == "/system":
        state.system = arg or None
        console.print("[dim]System prompt " + ("set." if arg else "removed.") + "[/]")
    else:
        console.print(f"[red]Unknown command {escape(name)}.[/] /help lists them.")
    return False
