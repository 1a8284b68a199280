"""`dflash-mlx generate PROMPT`: one prompt, streamed to stdout (or one JSON object)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from ..models.chat_template import reasoning_kwargs, render, template_source
from ..generation import stream_generate
from ..models.resolve import choose_block_size
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
from .common import KV_DEFAULTS, err_console, fail, kv_settings, load_models, lookup_flag, sharding_group, user_errors


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt ('-' reads it from stdin).")],
    model: ModelOpt = None,
    draft: DraftOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")] = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    block_size: BlockOpt = None,
    system: SystemOpt = None,
    reasoning: ReasoningOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: text and statistics.")] = False,
    no_dflash: Annotated[bool, typer.Option("--no-dflash", help="Plain decoding with the target only.")] = False,
    shard: ShardOpt = None,
    kv_bits: KVBitsOpt = KV_DEFAULTS["kv_bits"],
    kv_group_size: KVGroupSizeOpt = KV_DEFAULTS["kv_group_size"],
    quantized_kv_start: QuantizedKVStartOpt = KV_DEFAULTS["quantized_kv_start"],
    lookup: LookupOpt = "on",
) -> None:
    """Generate a reply to one prompt (chat-templated unless --raw)."""
    use_lookup = lookup_flag(lookup)
    if prompt == "-":
        prompt = sys.stdin.read()
    if max_tokens == 0 or max_tokens < -1:
        fail("--max-tokens: expected a positive integer (or -1 for no limit).")
    group = sharding_group(shard)
    choice, model_, tokenizer, drafter = load_models(model, draft, use_draft=not no_dflash, group=group)
    kv = kv_settings(model_, kv_bits, kv_group_size, quantized_kv_start)
    with user_errors():
        text = prompt
        if not raw:
            if template_source(tokenizer) is None:
                err_console.print("[dim]The model has no chat template: sending the prompt as is.[/]")
            else:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}
                ]
                kwargs = reasoning_kwargs(tokenizer, reasoning, choice.entry, choice.label)
                text = render(tokenizer, messages, kwargs)
        elif reasoning is not None or system is not None:
            fail("--reasoning and --system need the chat template (drop --raw).")
        b = choose_block_size(block_size, choice.entry, model_, drafter)
    stats = RunStats(block_size=b.size, adaptive=b.adaptive)
    pieces = []
    stats.begin()
    try:
        for response in stream_generate(
            model_,
            drafter,
            tokenizer,
            text,
            max_tokens=max_tokens,
            **b.generation_kwargs(),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            lookup=use_lookup,
            **kv,
        ):
            stats.add(response)
            pieces.append(response.text)
            if not as_json:
                sys.stdout.write(response.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if not as_json:
            sys.stdout.write("\n")
        err_console.print("[yellow]interrupted[/]")
    if as_json:
        out = {
            "text": "".join(pieces),
            "tokens": stats.tokens,
            "tps": stats.tps,
            "acceptance_length": stats.acceptance_length,
            "histogram": stats.histogram_dict() if drafter is not None else {},
            "peak_memory_gb": stats.peak_memory_gb,
            "prompt_tokens": stats.prompt_tokens,
            "prefill_tps": stats.prefill_tps,
            "block_size": b.flag,
            "max_block_size": b.size,
            "block_sizes": stats.blocks_dict(),
            "mean_block_size": stats.mean_block_size,
            "sources": stats.sources_dict() if drafter is not None else {},
            "model": choice.label,
        }
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        sys.stdout.write("\n")
        accept = f", {stats.acceptance_length:.2f} tokens/cycle" if stats.acceptance_length else ""
        if stats.mean_block_size is not None and b.adaptive:
            accept += f", mean block {stats.mean_block_size:.1f} of {b.size}"
        if drafter is not None and stats.sources_line():
            accept += f" ({stats.sources_line()})"
        err_console.print(
            f"[dim]{stats.tokens} tokens, {stats.tps:.1f} tok/s{accept}, peak memory {stats.peak_memory_gb:.2f} GB[/]"
        )
