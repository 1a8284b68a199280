"""The benchmark: mlx-lm's own decoding against DFlash, same process, same prompts.

For every prompt (a conversation: MT-Bench has two turns, each later turn fed
the leg's own earlier reply) each leg runs in turn: the baseline is
`mlx_lm.stream_generate` (what users compare against), then DFlash with each
block choice (by default the adaptive block, then the drafter's fixed block),
then optionally mlx-lm's speculative decoding with an autoregressive draft
model. Every leg is warmed up first. Speeds are decode
speeds (prefill excluded): total tokens after each reply's first over the total
time after it, measured with one clock for all legs. `report` builds the JSON
record (`speedup` = `dflash_tps` / `baseline_tps` for the first block choice,
`runs` one record per block choice, with the blocks each verified). No terminal output here: callers pass
`on_prompt` for progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from ..models.chat_template import render, template_source
from ..generation import stream_generate
from ..models.resolve import BlockChoice
from ..stats import RunStats

WARMUP_TOKENS = 8


@dataclass
class Leg:
    name: str  # "baseline", "dflash", "mlx-lm-draft"
    block: BlockChoice = BlockChoice(None)
    stats: RunStats = field(default_factory=RunStats)
    prompts: list[dict] = field(default_factory=list)
    lookup: bool = True  # a dflash leg's copy-aware drafting

    def __post_init__(self) -> None:
        self.stats.block_size, self.stats.adaptive = self.block.size, self.block.adaptive

    @property
    def label(self) -> str:
        if self.name != "dflash":
            return self.name
        name = f"dflash auto≤{self.block.size}" if self.block.adaptive else f"dflash b={self.block.size}"
        return name if self.lookup else f"{name} lookup off"


@dataclass
class BenchSettings:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    template_kwargs: dict = field(default_factory=dict)
    raw: bool = False  # prompts as text, no chat template
    num_draft_tokens: int = 3  # for the mlx-lm-draft leg
    kv: dict = field(default_factory=dict)  # kv_bits, kv_group_size, quantized_kv_start: every leg alike


def _prompt_text(tokenizer, messages: list[dict], settings: BenchSettings) -> str:
    if settings.raw or template_source(tokenizer) is None:
        return "\n\n".join(m["content"] for m in messages)
    return render(tokenizer, messages, settings.template_kwargs)


def _stream(leg: Leg, model, tokenizer, drafter, draft_model, prompt: str, settings: BenchSettings, max_tokens: int):
    if leg.name == "dflash":
        return stream_generate(
            model,
            drafter,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            **leg.block.generation_kwargs(),
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            seed=settings.seed,
            lookup=leg.lookup,
            **settings.kv,
        )
    kwargs = {"sampler": make_sampler(settings.temperature, top_p=settings.top_p, top_k=settings.top_k), **settings.kv}
    if settings.temperature > 0:
        mx.random.seed(settings.seed)
    if leg.name == "mlx-lm-draft":
        kwargs.update(draft_model=draft_model, num_draft_tokens=settings.num_draft_tokens)
    return mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs)


def _run_conversation(leg, model, tokenizer, drafter, draft_model, turns, settings, max_tokens, record=True):
    messages, texts, tokens = [], [], []
    stats = RunStats(block_size=leg.block.size, adaptive=leg.block.adaptive)
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        prompt = _prompt_text(tokenizer, messages, settings)
        text, turn_stats = [], RunStats(block_size=leg.block.size, adaptive=leg.block.adaptive)
        turn_stats.begin()
        for response in _stream(leg, model, tokenizer, drafter, draft_model, prompt, settings, max_tokens):
            turn_stats.add(response)
            text.append(response.text)
            tokens.append(response.token)
        stats.merge(turn_stats)
        texts.append("".join(text))
        messages.append({"role": "assistant", "content": texts[-1]})
    if record:
        leg.stats.merge(stats)
    return texts, tokens, stats


def run_benchmark(
    model,
    tokenizer,
    drafter,
    conversations: list[list[str]],
    blocks: list[BlockChoice],
    settings: BenchSettings,
    *,
    draft_model=None,
    on_prompt: Callable[[int, str], None] | None = None,
    lookups: tuple[bool, ...] = (True,),
) -> list[Leg]:
    """Run every leg on every conversation; the baseline leg first in the result. A dflash leg per block
    and `lookups` setting (copy-aware drafting on, off or both), the legs alternating prompt by prompt."""
    if not conversations:
        raise ValueError("No prompts to benchmark.")
    legs = [Leg("baseline")] + [Leg("dflash", b, lookup=on) for b in blocks for on in lookups]
    if draft_model is not None:
        legs.append(Leg("mlx-lm-draft"))
    for leg in legs:  # warm-up: compile kernels, touch the weights
        _run_conversation(
            leg, model, tokenizer, drafter, draft_model, conversations[0][:1], settings, WARMUP_TOKENS, record=False
        )
    mx.reset_peak_memory()
    for i, turns in enumerate(conversations):
        baseline_tokens = None
        for leg in legs:
            if on_prompt:
                on_prompt(i, leg.label)
            if leg.name == "dflash":
                mx.reset_peak_memory()
            texts, tokens, stats = _run_conversation(
                leg, model, tokenizer, drafter, draft_model, turns, settings, settings.max_tokens
            )
            if leg.name == "dflash":
                leg.stats.peak_memory_gb = max(leg.stats.peak_memory_gb, mx.get_peak_memory() / 1e9)
            if baseline_tokens is None:
                baseline_tokens = tokens
            leg.prompts.append(
                {
                    "index": i,
                    "turns": len(turns),
                    "prompt_tokens": stats.prompt_tokens,
                    "tokens": stats.tokens,
                    "tps": round(stats.tps, 3),
                    "acceptance_length": stats.acceptance_length,
                    "matches_baseline": tokens == baseline_tokens,
                    "text": texts,
                }
            )
    return legs


def _run_record(baseline: Leg, leg: Leg) -> dict:
    accepted = [p["acceptance_length"] for p in leg.prompts if p["acceptance_length"] is not None]
    baseline_tps, dflash_tps = baseline.stats.tps, leg.stats.tps
    return {
        "block_size": leg.block.flag,
        "max_block_size": leg.block.size,
        "lookup": leg.lookup,
        "sources": leg.stats.sources_dict(),
        "block_sizes": leg.stats.blocks_dict(),
        "mean_block_size": leg.stats.mean_block_size,
        "speedup": dflash_tps / baseline_tps if baseline_tps else None,
        "acceptance_length": sum(accepted) / len(accepted) if accepted else None,
        "baseline_tps": baseline_tps,
        "dflash_tps": dflash_tps,
        "histogram": leg.stats.histogram_dict(),
        "per_position_acceptance": leg.stats.per_position_acceptance(),
        "prefill_tps": leg.stats.prefill_tps,
        "peak_memory_gb": leg.stats.peak_memory_gb,
        "baseline_tokens": baseline.stats.tokens,
        "dflash_tokens": leg.stats.tokens,
        "greedy_matches": all(p["matches_baseline"] for p in leg.prompts),
        "prompts": [
            dict(p, baseline_tps=b["tps"], baseline_tokens=b["tokens"]) for p, b in zip(leg.prompts, baseline.prompts)
        ],
    }


def report(legs: list[Leg], environment: dict, meta: dict) -> dict:
    """The JSON document: the first block size's record at the top level, all in `runs`."""
    baseline = legs[0]
    runs = [_run_record(baseline, leg) for leg in legs if leg.name == "dflash"]
    out = dict(runs[0])
    out["runs"] = runs
    draft_leg = next((leg for leg in legs if leg.name == "mlx-lm-draft"), None)
    if draft_leg is not None:
        tps = draft_leg.stats.tps
        out["mlx_lm_draft"] = {
            "tps": tps,
            "speedup": tps / baseline.stats.tps if baseline.stats.tps else None,
            "greedy_matches": all(p["matches_baseline"] for p in draft_leg.prompts),
        }
    out["environment"] = dict(environment, block_size=runs[0]["block_size"])
    out.update(meta)
    return out
