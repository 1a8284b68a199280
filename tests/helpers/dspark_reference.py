"""The DSpark yardstick: PyPI mlx-dspark 0.20.3's own `DSparkConfig` and `DSparkDrafter`, loaded for tests only.

Its package ``__init__`` needs Metal, so ``config.py`` and ``model.py`` are
loaded directly from their files (as a throwaway package, never under the name
``mlx_dspark``). ``model.py`` imports one mlx-vlm helper (``initialize_rope``);
mlx-vlm is not installed, so while the file executes a throwaway module object
stands in for it in ``sys.modules``, giving mlx-lm's ``initialize_rope`` (the
same signature and rope types), and ``sys.modules`` is restored afterwards.
Drafters are loaded as the reference's ``load.load_drafter`` loads them (its
reuse flags from the weights, ``d2t`` and ``t2d`` popped, qwen3_5 norms made
plain, the offsets installed) but without its default 4-bit quantization.

A missing yardstick fails the test with the command that installs it: a parity
test that skipped would prove nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

INSTALL = "python3 -m pip install --no-deps mlx-dspark==0.20.3"
VERSION = "0.20.3"
ROPE_HELPER = "mlx_vlm.models.gemma4.rope_utils"
PACKAGE = "_dspark_yardstick"


@functools.lru_cache(maxsize=1)
def reference() -> types.SimpleNamespace:
    """(config, model) modules of the installed mlx-dspark (fails the test when it is not installed)."""
    spec = importlib.util.find_spec("mlx_dspark")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the DSpark yardstick mlx-dspark {VERSION} is not installed: {INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0])
    version = (folder / "__init__.py").read_text()
    if f'__version__ = "{VERSION}"' not in version:
        pytest.fail(f"mlx-dspark in {folder} is not version {VERSION}: {INSTALL}")
    from mlx_lm.models.rope_utils import initialize_rope

    stub = types.ModuleType(ROPE_HELPER)
    stub.initialize_rope = initialize_rope
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    added = {ROPE_HELPER: stub, PACKAGE: package}
    saved = {name: sys.modules.get(name) for name in (*added, f"{PACKAGE}.config", f"{PACKAGE}.model")}
    try:
        sys.modules.update(added)
        config = _load(f"{PACKAGE}.config", folder / "config.py")
        model = _load(f"{PACKAGE}.model", folder / "model.py")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return types.SimpleNamespace(config=config, model=model)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_reference_drafter(path: Path, target_head=None, target_embed=None):
    """The reference's drafter for a checkpoint directory, unquantized (see the module docstring); a head or
    embedding the checkpoint lacks is bound to the target's (`target_head`, `target_embed`: callables)."""
    ref = reference()
    config = ref.config.DSparkConfig.from_json(str(Path(path) / "config.json"))
    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    config.has_own_embed = "embed_tokens.weight" in weights
    config.has_own_lm_head = "lm_head.weight" in weights
    drafter = ref.model.DSparkDrafter(config)
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    drafter.load_weights(list(weights.items()), strict=True)
    if config.offset_rms_norm:
        for _, module in drafter.named_modules():
            if isinstance(module, nn.RMSNorm):
                module.weight = module.weight + 1.0
    if d2t is not None:
        drafter.set_draft_vocab_map(d2t)
    if not config.has_own_lm_head:
        drafter.bind_lm_head(target_head)
    if not config.has_own_embed:
        drafter.bind_embed(target_embed)
    mx.eval(drafter.parameters())
    return drafter


class ReferenceDrafting:
    """The reference drafting one block after another, as its speculative loop does (greedy)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.caches = drafter.make_ctx_cache()
        self.context = 0  # positions whose features the drafter holds

    def add_context(self, features: mx.array) -> None:
        self.drafter.update_context(features, ctx_offset=self.context, ctx_caches=self.caches)
        self.context += features.shape[1]

    def draft(self, anchor: int, count: int) -> tuple[list[int], mx.array | None]:
        """Greedy drafts after `anchor` (at position `self.context`) and their confidence (None without)."""
        d, config = self.drafter, self.drafter.config
        width = d.draft_width(count)
        block = mx.array([[anchor] + [config.mask_token_id] * (width - 1)])
        hidden = d.backbone(d.embed(block), self.context, self.caches)
        rows = d.head_slice(hidden, count)
        drafts = d.sample_block(d.compute_logits(rows)[0], first_prev_token=anchor)
        confidence = None
        if d.confidence_head is not None:
            previous = mx.concatenate([mx.array([anchor], drafts.dtype), drafts[:-1]])
            confidence = mx.sigmoid(d.confidence_logits(rows[0], previous))
        return drafts.tolist(), confidence


# (context rows handed over, drafts asked: None for the most) per cycle: a long first context, then what
# cycles commit
CYCLES = [(20, None), (3, 1), (1, 3), (4, None), (2, 2)]


def check_drafts_match_the_reference(model, draft_dir, sequence_seed: int = 0) -> None:
    """Our proposer (`load_draft` + `as_proposer`) and the reference draft the same tokens, and give the same
    confidences, over CYCLES from one context of the target's features."""
    import numpy as np

    from dflash_mlx import load_draft
    from dflash_mlx.proposers import DSparkProposer, as_proposer
    from dflash_mlx.targets.adapter import TargetAdapter

    from .checks import prompt_ids

    ours = load_draft(draft_dir, model)
    target = TargetAdapter(model, ours.config.target_layer_ids)
    ref = ReferenceDrafting(load_reference_drafter(draft_dir, target.head, target.embed))
    assert ref.drafter.max_draft == ours.config.max_drafts == ours.block_size - 1
    proposer = as_proposer(ours, model)
    assert isinstance(proposer, DSparkProposer) and proposer.name == "dspark"
    sequence = prompt_ids(40, seed=sequence_seed)
    _, features = target.forward(mx.array(sequence)[None], target.make_cache(), logits=False)
    proposer.start(target, mx.array(sequence[:20]))
    position = 0
    for rows, count in CYCLES:
        count = count or ours.config.max_drafts
        proposer.add_context(features[:, position : position + rows])
        ref.add_context(features[:, position : position + rows])
        position += rows
        anchor = sequence[position]
        got = proposer.propose(mx.array([anchor]), position, count).tokens.tolist()
        want, confidence = ref.draft(anchor, count)
        assert got == want, (position, count)
        if confidence is not None:
            ours_confidence = _our_confidence(proposer, anchor, position, got)
            np.testing.assert_allclose(np.array(ours_confidence), np.array(confidence), atol=1e-5)


def _our_confidence(proposer, anchor: int, position: int, drafts: list[int]) -> mx.array:
    """Our confidence head's estimates for `drafts` (the rows' hidden states of the block drafted again)."""
    drafter = proposer.drafter
    block, features = proposer._block(mx.array([anchor]), position, drafter.block_width(len(drafts)) - 1)
    hidden = drafter.hidden_states(block, proposer._cache, proposer.target, features)[0]
    start = drafter.config.logits_start
    previous = mx.array([anchor] + drafts[:-1], mx.int32)
    return drafter.confidence(hidden[start : start + len(drafts)], previous)
