"""``dflash-mlx serve``: the Typer command in front of `dflash_mlx.server`.

Loads the pair as the other commands do (`cli.common.load_models`: the bundled
demo pair without ``--model``; float32 on a CPU; the registered drafter unless
``--draft``), binds, prints the URL and serves
until Ctrl-C or SIGTERM, then stops cleanly (`server.app.DFlashServer.stop`).
With ``--shard tensor`` (under ``mlx.launch``) rank 0 serves HTTP and the
other ranks follow its worker (`server.worker.GenerationWorker.follow`).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer
from mlx_lm.utils import _parse_size

from ..models.resolve import choose_block_size
from ..server.app import make_server, make_worker
from ..models.chat_template import reasoning_kwargs
from .common import (
    KV_DEFAULTS,
    DraftOpt,
    KVBitsOpt,
    KVGroupSizeOpt,
    LookupOpt,
    ModelOpt,
    QuantizedKVStartOpt,
    ReasoningOpt,
    ShardOpt,
    fail,
    kv_settings,
    load_models,
    lookup_flag,
    sharding_group,
    user_errors,
)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _size(text: str, flag: str = "--prompt-cache-bytes") -> int:
    """mlx_lm.server's sizes: a number with an optional M, MB, G or GB."""
    try:
        return _parse_size(text)
    except (KeyError, ArithmeticError, ValueError):
        raise typer.BadParameter(f"expected a size such as 8GB or 500MB, got {text!r}", param_hint=flag) from None


def serve(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).", min=0, max=65535)] = 8080,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Default max_tokens of requests that give none.")
    ] = 512,
    block_size: Annotated[
        Optional[str],
        typer.Option(
            "--block-size",
            metavar="auto|N",
            help="Default block (anchor included): auto (default) chooses per "
            "cycle up to the registry's or the drafter's block (at most 5 for <=4-bit models); N fixes it. "
            "Requests' num_draft_tokens fix it for that request.",
        ),
    ] = None,
    chat_template_args: Annotated[
        Optional[str],
        typer.Option(
            "--chat-template-args",
            help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}' "
            "(over --reasoning; requests' chat_template_kwargs go over both).",
        ),
    ] = None,
    reasoning: ReasoningOpt = None,
    draft_bits: Annotated[Optional[int], typer.Option("--draft-bits", help="Quantize the drafter (4 or 8).")] = None,
    log_requests: Annotated[bool, typer.Option("--log-requests", help="Log each HTTP request.")] = False,
    prompt_cache_size: Annotated[
        int,
        typer.Option(
            "--prompt-cache-size", min=0, help="Conversations whose caches are kept (least recently used go first)."
        ),
    ] = 10,
    prompt_cache_bytes: Annotated[
        Optional[str],
        typer.Option(
            "--prompt-cache-bytes",
            metavar="SIZE",
            help="Bound on the kept caches' memory of their own, within --max-batch-bytes, e.g. 8GB or 500MB "
            "(default: none).",
        ),
    ] = None,
    prompt_cache_dir: Annotated[
        Optional[Path],
        typer.Option(
            "--prompt-cache-dir",
            help="Keep the prompt cache in this directory too, for use after a restart.",
            file_okay=False,
        ),
    ] = None,
    decode_concurrency: Annotated[
        int,
        typer.Option(
            "--decode-concurrency",
            min=1,
            help="Requests decoded together in one batch (mlx_lm.server's flag and default; 1: one at a time).",
        ),
    ] = 32,
    prefill_step_size: Annotated[
        int,
        typer.Option(
            "--prefill-step-size",
            min=1,
            help="Prompt tokens per prefill chunk; a longer prompt joining a batch is prefilled a chunk per step.",
        ),
    ] = 2048,
    max_batch_bytes: Annotated[
        Optional[str],
        typer.Option(
            "--max-batch-bytes",
            metavar="SIZE",
            help="The one byte budget of everything the server keeps (weights, active requests, prompt cache, "
            "stored responses, grammars; the least recently used go first), in every worker mode: a request "
            "whose caches would not fit waits (default: 3/4 of the device's memory; /health shows its use).",
        ),
    ] = None,
    shard: ShardOpt = None,
    kv_bits: KVBitsOpt = KV_DEFAULTS["kv_bits"],
    kv_group_size: KVGroupSizeOpt = KV_DEFAULTS["kv_group_size"],
    quantized_kv_start: QuantizedKVStartOpt = KV_DEFAULTS["quantized_kv_start"],
    api_key: Annotated[
        Optional[str],
        typer.Option(
            "--api-key",
            envvar="DFLASH_MLX_API_KEY",
            help="Require this key (x-api-key or Authorization: Bearer) on every route but /health (default: none).",
        ),
    ] = None,
    response_store_size: Annotated[
        int,
        typer.Option(
            "--response-store-size",
            min=0,
            help="Responses API: conversations kept for previous_response_id (least recently used go first).",
        ),
    ] = 100,
    lookup: LookupOpt = "on",
) -> None:
    """Serve a model over OpenAI's and Anthropic's HTTP APIs with DFlash speculative decoding."""
    use_lookup = lookup_flag(lookup)  # (the default of requests that do not send "lookup")
    cache_bytes = _size(prompt_cache_bytes) if prompt_cache_bytes is not None else None
    batch_bytes = _size(max_batch_bytes, "--max-batch-bytes") if max_batch_bytes is not None else None
    template_args = {}
    if chat_template_args is not None:
        try:
            template_args = json.loads(chat_template_args)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"not valid JSON: {e}", param_hint="--chat-template-args") from None
        if not isinstance(template_args, dict):
            raise typer.BadParameter("expected a JSON object", param_hint="--chat-template-args")
    group = sharding_group(shard)
    if group is not None and prompt_cache_dir is not None:
        fail(
            "--prompt-cache-dir and --shard: a sharded server keeps its prompt cache in memory only (the ranks' "
            "caches must stay alike)."
        )
    choice, target, tokenizer, drafter = load_models(model, draft, draft_bits=draft_bits, group=group)
    kv = kv_settings(target, kv_bits, kv_group_size, quantized_kv_start)
    with user_errors():
        block = choose_block_size(block_size, choice.entry, target, drafter)
        if tokenizer.has_chat_template:  # the registry's reasoning default applies as in chat and generate
            template_args = {**reasoning_kwargs(tokenizer, reasoning, choice.entry, choice.label), **template_args}
        elif reasoning is not None:
            raise typer.BadParameter("the model has no chat template to switch reasoning in", param_hint="--reasoning")
    if group is not None and group.rank() != 0:  # a follower: rank 0 listens and sends it the requests
        make_worker(
            target,
            tokenizer,
            drafter,
            block_size=block.size,
            adaptive=block.adaptive,
            prompt_cache_size=prompt_cache_size,
            prompt_cache_bytes=cache_bytes,
            group=group,
            kv=kv,
        ).follow()
        return
    server = make_server(
        target,
        tokenizer,
        drafter,
        host=host,
        port=port,
        model_id=choice.label,
        draft_id=getattr(drafter, "source", draft),
        max_tokens=max_tokens,
        block_size=block.size,
        adaptive=block.adaptive,
        chat_template_args=template_args,
        log_requests=log_requests,
        prompt_cache_size=prompt_cache_size,
        prompt_cache_bytes=cache_bytes,
        prompt_cache_dir=prompt_cache_dir,
        group=group,
        decode_concurrency=decode_concurrency,
        prefill_step_size=prefill_step_size,
        max_batch_bytes=batch_bytes,
        kv=kv,
        api_key=api_key,
        response_store_size=response_store_size,
        registry_entry=choice.entry,
        lookup=use_lookup,
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        ranks = f", tensor-sharded over {group.size()} ranks" if group is not None else ""
        typer.echo(
            f"dflash-mlx serving {choice.label} (drafter {server.draft_id}{ranks}) at {server.url}/v1 (Ctrl-C stops)",
            err=True,
        )
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
        typer.echo("dflash-mlx serve: stopped", err=True)
