"""``python -m dflash_mlx generate``: ``mlx_lm generate``'s command line, decoding with DFlash.

The flags are mlx-lm's own (its ``setup_arg_parser``: same names, defaults and
help) and so is the output: the text between ``==========`` lines, then the
``Prompt:``, ``Generation:`` and ``Peak memory:`` lines (``--verbose False``
prints the text only). When DFlash ran, one more line follows them:
``DFlash: C cycles, T tokens per cycle, D drafted tokens accepted``.

Differences, each explicit:

- ``--model`` is required; registry names (models.toml) are accepted.
- ``--draft-model`` is a DFlash drafter (directory or repo id), defaulting to
  the one models.toml registers for ``--model``; an ordinary mlx-lm model there
  runs mlx-lm's own speculative decoding, as in ``mlx_lm generate``.
- ``--num-draft-tokens n`` means blocks of n + 1; by default the drafter's own
  block size (mlx-lm's default of 3 applies to an ordinary draft model).
- Options DFlash cannot honour (``--xtc-probability``, ``--kv-bits``,
  ``--max-kv-size``, ``--min-tokens-to-keep`` > 1 with ``--min-p``) decode
  with mlx-lm instead, with a warning (see `dflash_mlx.mlx_lm`).
- ``--image`` and ``--prompt-cache-file`` are refused (use ``mlx_lm generate``).
- ``--seed`` seeds MLX's generator, from which sampled DFlash takes its seed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import setup_arg_parser
from mlx_lm.sample_utils import make_sampler

from . import api as plugin
from ..draft.load import resolve_model_dir
from ..stats import RunStats

PROG = "python -m dflash_mlx generate"


def build_parser():
    parser = setup_arg_parser()
    parser.prog = PROG
    parser.description = "mlx_lm generate with lossless DFlash speculative decoding."
    helps = {
        "model": "The target: a local mlx-lm directory, a Hugging Face repo id or a models.toml name.",
        "draft_model": "A DFlash drafter (directory or repo id); default: the one models.toml registers "
        "for --model. An ordinary mlx-lm model runs mlx-lm's speculative decoding.",
        "num_draft_tokens": "Tokens drafted per cycle (blocks of n + 1); default: the drafter's block "
        "size (3 for an ordinary mlx-lm draft model).",
    }
    for action in parser._actions:
        if action.dest in helps:
            action.help = helps[action.dest]
    parser.set_defaults(num_draft_tokens=None)
    return parser


def is_dflash_checkpoint(model_dir: Path) -> bool:
    """Whether a model directory holds a DFlash drafter (v1 or v2) rather than an mlx-lm model."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "dflash_config" in config or any("DFlash" in a for a in config.get("architectures") or [])


def _load(args, parser):
    """(model, tokenizer, explicit draft model or None); the DFlash drafter is remembered."""
    kwargs = dict(
        adapter_path=args.adapter_path,
        tokenizer_config={"trust_remote_code": args.trust_remote_code},
        model_config={"quantize_activations": args.quantize_activations},
        trust_remote_code=args.trust_remote_code,
    )
    if args.draft_model is None:
        model, tokenizer = plugin.load(args.model, **kwargs)
        return model, tokenizer, None
    draft_dir = resolve_model_dir(args.draft_model)
    if is_dflash_checkpoint(draft_dir):
        model, tokenizer = plugin.load(args.model, draft=draft_dir, **kwargs)
        return model, tokenizer, None
    model, tokenizer = plugin.load(args.model, **kwargs)
    draft_model, draft_tokenizer = mlx_lm.load(args.draft_model)
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        parser.error("--draft-model: the draft model's tokenizer does not match the model's.")
    if args.num_draft_tokens is None:
        args.num_draft_tokens = 3  # mlx_lm generate's default
    return model, tokenizer, draft_model


def _prompt(args, tokenizer) -> list[int]:
    """The prompt tokens, exactly as mlx_lm generate builds them."""
    template_kwargs = json.loads(args.chat_template_config) if args.chat_template_config is not None else {}
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        has_prefill = args.prefill_response is not None
        if has_prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        prompt = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            continue_final_message=has_prefill,
            add_generation_prompt=not has_prefill,
            **template_kwargs,
        )
    return tokenizer.encode(prompt, add_special_tokens=not use_chat_template)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model is required (a models.toml name, a Hugging Face repo id or a local directory).")
    if args.image:
        parser.error("--image: dflash-mlx decodes text only; use `mlx_lm generate` for images.")
    if args.prompt_cache_file is not None:
        parser.error(
            "--prompt-cache-file holds mlx-lm caches, which cannot hold a DFlash drafter's state; "
            "use `mlx_lm generate` for it."
        )
    if args.use_default_chat_template:
        print("[WARNING] --use-default-chat-template has no effect (as in mlx_lm generate).", file=sys.stderr)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer, draft_model = _load(args, parser)
    for eos_token in args.extra_eos_token:
        tokenizer.add_eos_token(eos_token)
    prompt = _prompt(args, tokenizer)
    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )
    responses = plugin.stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        draft_model=draft_model,
        sampler=sampler,
        max_kv_size=args.max_kv_size,
        prefill_step_size=args.prefill_step_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        num_draft_tokens=args.num_draft_tokens,
    )
    _print(responses, args.verbose)


def _print(responses, verbose: bool) -> None:
    """mlx_lm generate's output, plus the DFlash line when cycles ran."""
    stats = RunStats()
    text = plugin.consume(responses, verbose, stats.add)
    if not verbose:
        print(text)
    elif text and stats.cycles:
        print(
            f"DFlash: {stats.cycles} cycles, {stats.acceptance_length:.2f} tokens per cycle, "
            f"{stats.drafted} drafted tokens accepted"
        )


if __name__ == "__main__":
    main()
