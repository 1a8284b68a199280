"""Test helpers: tiny on-disk models and the checks the test modules share (no network).

- ``tokenizer``: special tokens and ids, the BPE corpus, the chat template, ``make_tokenizer``.
- ``families``: the family lists and per-family target configs (``target_config``).
- ``builders``: random weights, ``make_target``, ``make_draft``, draft weight shapes,
  ``derive_target_layer_ids``; ``drafts2``: ``make_draft2`` (DFlash 2 drafters).
- ``constant_draft``: a drafter that always proposes one token (``make_constant_draft``).
- ``mtp_targets``: targets whose checkpoints keep MTP heads under their family's names (``make_mtp_target``).
- ``runtime``: ``load_pair`` (cached: share read-only) and ``greedy_with_margins``.
- ``checks``: prompts, mlx-lm references, stream comparisons, ``with_eos`` / ``without_eos``.
- ``train_cli``: ``dflash-mlx train`` through Typer's CliRunner (import it from there: it
  loads the training command, which the other test modules do not need).

Test modules import from here (``from helpers import load_pair, TINY_VOCAB``); conftest.py
builds the session fixtures (``tiny_target``, ``tiny_draft``, ``tiny_pair``, ...) on top.
"""

from .builders import derive_target_layer_ids, draft_weight_shapes, make_draft, make_target
from .drafts2 import draft2_weight_shapes, make_draft2
from .checks import (
    assert_cycle_accounting,
    assert_same_stream,
    check_a_seed_fixes_the_text,
    check_first_two_sampled_tokens,
    check_keyed_drafts,
    check_follows,
    check_lossless,
    chi_square_p,
    oracle_cycle_sizes,
    ours,
    prompt_ids,
    reference,
    run_both,
    two_token_distributions,
    with_eos,
    without_eos,
)
from .constant_draft import make_constant_draft, repeated_token
from .mtp_targets import MTP_FAMILIES, make_mtp_target, mtp_config, mtp_stage_reference
from .families import (
    ALL_FAMILIES,
    DEFAULT_SLIDING_WINDOW,
    EXTRA_FAMILIES,
    FAMILIES,
    HYBRID_FAMILIES,
    MOE_FAMILIES,
    NESTED_FAMILIES,
    SLIDING_FAMILIES,
    target_config,
)
from .runtime import greedy_with_margins, load_pair
from .tokenizer import (
    BOS_ID,
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_ID,
    EOS_TOKEN,
    IM_END_ID,
    IM_END_TOKEN,
    IM_START_ID,
    IM_START_TOKEN,
    MASK_ID,
    MASK_TOKEN,
    PAD_ID,
    SPECIAL_TOKENS,
    TINY_VOCAB,
    make_tokenizer,
)

__all__ = [
    "ALL_FAMILIES",
    "BOS_ID",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "DEFAULT_SLIDING_WINDOW",
    "EOS_ID",
    "EOS_TOKEN",
    "EXTRA_FAMILIES",
    "FAMILIES",
    "HYBRID_FAMILIES",
    "IM_END_ID",
    "IM_END_TOKEN",
    "IM_START_ID",
    "IM_START_TOKEN",
    "MASK_ID",
    "MASK_TOKEN",
    "MOE_FAMILIES",
    "MTP_FAMILIES",
    "NESTED_FAMILIES",
    "PAD_ID",
    "SLIDING_FAMILIES",
    "SPECIAL_TOKENS",
    "TINY_VOCAB",
    "assert_cycle_accounting",
    "assert_same_stream",
    "check_a_seed_fixes_the_text",
    "check_first_two_sampled_tokens",
    "check_keyed_drafts",
    "check_follows",
    "check_lossless",
    "chi_square_p",
    "derive_target_layer_ids",
    "draft2_weight_shapes",
    "draft_weight_shapes",
    "greedy_with_margins",
    "load_pair",
    "make_constant_draft",
    "make_draft",
    "make_draft2",
    "make_mtp_target",
    "make_target",
    "make_tokenizer",
    "oracle_cycle_sizes",
    "ours",
    "prompt_ids",
    "mtp_config",
    "mtp_stage_reference",
    "reference",
    "repeated_token",
    "run_both",
    "two_token_distributions",
    "target_config",
    "with_eos",
    "without_eos",
]
