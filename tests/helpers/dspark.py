"""DSpark drafters in the published checkpoint formats (random weights, no network): ``make_dspark``.

One drafter, four packagings (the config.json each publisher writes; the
tensor names are DeepSpec's in all of them):

- ``deepspec``: DeepSpec's own, every field at the top level;
- ``speculators``: vLLM speculators (``transformer_layer_config``,
  ``aux_hidden_state_layer_ids``, ``speculators_config.proposal_methods[0]
  .speculative_tokens``), optionally a reduced ``draft_vocab_size`` with
  ``d2t`` / ``t2d`` tables;
- ``specforge``: a Qwen3 config with ``dflash_config`` tagged
  ``projector_type: "dspark"``;
- ``liquid``: "Lfm2DSparkDraftModel" with an untagged ``dflash_config``
  (no DSpark fields at the top level: the Markov rank is the default 256).

Backbones: ``qwen3``, ``qwen3_5`` (gated q_proj, norm weights stored as offsets
from one, partial rotary) and ``gemma4`` (keys as values, sandwich norms, a
layer scalar, a logit softcap). ``logits_start`` 0 (slot 0 predicts) or 1 (a
pure anchor slot). Tensor shapes are written out here from the formats, not
read from either implementation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .builders import _normal, derive_target_layer_ids
from .tokenizer import MASK_ID, write_json

PACKAGINGS = ("deepspec", "speculators", "specforge", "liquid")
BACKBONES = ("qwen3", "qwen3_5", "gemma4")
DEFAULT_RANK = 256  # the Markov rank a config without markov_rank gets (Liquid's)
GEMMA_HEAD_DIM = 32


def dspark_weight_shapes(cfg: dict) -> dict:
    """{tensor: shape} of a DSpark drafter described by ``cfg`` (make_dspark's own summary, below)."""
    H, inter, L = cfg["hidden"], cfg["intermediate"], cfg["layers"]
    nh, nkv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    V, Vd, r = cfg["vocab"], cfg["draft_vocab"] or cfg["vocab"], cfg["rank"]
    gemma = cfg["backbone"] == "gemma4"
    per_layer = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
        "self_attn.q_proj.weight": (nh * hd * (2 if cfg["backbone"] == "qwen3_5" else 1), H),
        "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.o_proj.weight": (H, nh * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
    }
    if not gemma:
        per_layer["self_attn.v_proj.weight"] = (nkv * hd, H)
    else:
        per_layer.update(
            {
                "pre_feedforward_layernorm.weight": (H,),
                "post_feedforward_layernorm.weight": (H,),
                "layer_scalar": (1,),
            }
        )
    shapes = {f"layers.{i}.{k}": s for i in range(L) for k, s in per_layer.items()}
    shapes.update({"fc.weight": (H, cfg["taps"] * H), "hidden_norm.weight": (H,), "norm.weight": (H,)})
    if cfg["own_embedding"]:
        shapes["embed_tokens.weight"] = (V, H)
    if cfg["own_head"]:
        shapes["lm_head.weight"] = (Vd, H)
    if r:
        shapes.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (Vd, r)})
    if cfg["sink"]:
        shapes.update({f"layers.{i}.self_attn.attention_sink_bias": (nh,) for i in range(L)})
    if cfg["confidence"]:
        shapes.update({"confidence_head.proj.weight": (1, H + r), "confidence_head.proj.bias": (1,)})
    return shapes


def _init(seed: int, name: str, shape, head_std: float, offset_norms: bool) -> np.ndarray:
    if name.endswith("norm.weight"):
        return (0.0 if offset_norms else 1.0) + _normal(seed, name, shape, 0.05)
    if name.endswith("layer_scalar"):
        return np.ones(shape, np.float32)
    if name.endswith(".bias"):
        return _normal(seed, name, shape, 0.5)
    if name.endswith("embed_tokens.weight"):
        return _normal(seed, name, shape, 1.0)
    if name.endswith(("lm_head.weight", "markov_w2.weight")):
        return _normal(seed, name, shape, head_std)
    if name.endswith("markov_w1.weight"):
        return _normal(seed, name, shape, 1.0)
    return _normal(seed, name, shape, shape[-1] ** -0.5)


def make_dspark(
    out_dir: Path,
    target_dir: Path,
    *,
    packaging: str = "deepspec",
    backbone: str = "qwen3",
    block_size: int = 7,
    logits_start: int = 0,
    num_layers: int = 2,
    target_layer_ids: Optional[Sequence[int]] = None,
    markov_rank: int = 16,
    confidence: bool = True,
    own_embedding: bool = True,
    own_head: bool = True,
    draft_vocab_size: Optional[int] = None,
    head_std: float = 1.0,
    seed: int = 3,
    **config_overrides,
) -> Path:
    """Write a DSpark drafter for the target in ``target_dir`` (see the module docstring); ``config_overrides``
    go into config.json at the top level, last. Heads have std ``head_std`` (logits std ~ sqrt(H) x head_std)."""
    if packaging not in PACKAGINGS or backbone not in BACKBONES:
        raise ValueError(f"packaging in {PACKAGINGS}, backbone in {BACKBONES}")
    if packaging == "liquid":
        markov_rank = DEFAULT_RANK
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    n_target, H = tcfg["num_hidden_layers"], tcfg["hidden_size"]
    taps = list(target_layer_ids or derive_target_layer_ids(num_layers, n_target))
    gemma = backbone == "gemma4"
    summary = dict(
        backbone=backbone,
        hidden=H,
        intermediate=tcfg["intermediate_size"],
        layers=num_layers,
        heads=tcfg["num_attention_heads"],
        kv_heads=1 if gemma else tcfg["num_key_value_heads"],
        head_dim=GEMMA_HEAD_DIM if gemma else tcfg.get("head_dim") or H // tcfg["num_attention_heads"],
        vocab=tcfg["vocab_size"],
        draft_vocab=draft_vocab_size,
        rank=markov_rank,
        taps=len(taps),
        own_embedding=own_embedding,
        own_head=own_head,
        confidence=confidence,
        sink=bool(config_overrides.get("attention_sink_bias")),
    )
    weights = {
        name: mx.array(_init(seed, name, shape, head_std, backbone == "qwen3_5"))
        for name, shape in dspark_weight_shapes(summary).items()
    }
    if draft_vocab_size:
        weights.update(_draft_vocab_tables(seed, summary["vocab"], draft_vocab_size))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
    config = _config(packaging, summary, tcfg, taps, n_target, block_size, logits_start)
    config.update(config_overrides)
    write_json(out_dir / "config.json", config)
    return out_dir


def _draft_vocab_tables(seed: int, vocab: int, draft_vocab: int) -> dict:
    """``d2t`` offsets (target id = draft id + d2t[draft id]) over a random subset of target ids (the mask
    token's neighbours included), and the ``t2d`` membership mask."""
    rng = np.random.default_rng([seed, 7])
    chosen = np.sort(rng.choice(vocab, size=draft_vocab, replace=False))
    member = np.zeros(vocab, bool)
    member[chosen] = True
    return {"d2t": mx.array(chosen - np.arange(draft_vocab)), "t2d": mx.array(member)}


def _backbone_fields(summary: dict, tcfg: dict) -> dict:
    theta = tcfg.get("rope_theta", 10000.0)
    base = dict(
        hidden_size=summary["hidden"],
        vocab_size=summary["vocab"],
        num_hidden_layers=summary["layers"],
        intermediate_size=summary["intermediate"],
        num_attention_heads=summary["heads"],
        num_key_value_heads=summary["kv_heads"],
        head_dim=summary["head_dim"],
        rms_norm_eps=tcfg.get("rms_norm_eps", 1e-6),
    )
    if summary["backbone"] == "qwen3":
        return dict(base, model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": theta})
    if summary["backbone"] == "qwen3_5":
        rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}
        return dict(base, model_type="qwen3_5", enable_qwen35_gated_q_proj=True, rope_parameters=rope)
    rope = {"full_attention": {"rope_type": "proportional", "rope_theta": theta, "partial_rotary_factor": 0.25}}
    return dict(
        base,
        model_type="gemma4_text",
        global_head_dim=summary["head_dim"],
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        final_logit_softcapping=30.0,
        rope_parameters=rope,
    )


def _config(packaging, summary, tcfg, taps, n_target, block_size, logits_start) -> dict:
    backbone = _backbone_fields(summary, tcfg)
    dspark = dict(
        markov_rank=summary["rank"],
        markov_head_type="vanilla",
        enable_confidence_head=summary["confidence"],
        confidence_head_with_markov=True,
    )
    if packaging == "deepspec":
        config = dict(architectures=["DSparkDraftModel"], **backbone, **dspark)
        config.update(block_size=block_size, mask_token_id=MASK_ID, target_layer_ids=taps, num_target_layers=n_target)
        if logits_start:
            config["logits_start"] = logits_start
        return config
    if packaging == "speculators":
        method = {"proposal_type": "greedy", "speculative_tokens": block_size - logits_start}
        config = dict(
            architectures=["DSparkSpeculator"],
            speculators_model_type="dspark",
            speculators_config={
                "algorithm": "dspark",
                "proposal_methods": [method],
                "default_proposal_method": "greedy",
            },
            transformer_layer_config=backbone,
            aux_hidden_state_layer_ids=taps,
            block_size=block_size,
            mask_token_id=MASK_ID,
            **dspark,
        )
        if summary["draft_vocab"]:
            config["draft_vocab_size"] = summary["draft_vocab"]
        return config
    nested = {"target_layer_ids": taps, "mask_token_id": MASK_ID}
    if packaging == "specforge":
        nested["projector_type"] = "dspark"
        return dict(
            architectures=["DSparkDraftModel"], **backbone, **dspark, block_size=block_size, dflash_config=nested
        )
    nested["num_target_layers"] = n_target
    return dict(architectures=["Lfm2DSparkDraftModel"], **backbone, block_size=block_size, dflash_config=nested)


def make_markov_dspark(out_dir: Path, target_dir: Path, successors: np.ndarray, gain: float = 30.0, **kw) -> Path:
    """A DSpark drafter whose Markov head alone predicts: a bias of `gain` on successors[previous token]
    (a rank-V head: markov_w1 the identity, markov_w2 the successor table), its backbone's head near zero."""
    vocab = successors.size
    make_dspark(out_dir, target_dir, markov_rank=vocab, head_std=1e-3, **kw)
    file = Path(out_dir) / "model.safetensors"
    weights = dict(mx.load(str(file)))
    table = np.zeros((vocab, vocab), np.float32)
    table[successors, np.arange(vocab)] = gain
    weights["markov_head.markov_w1.weight"] = mx.eye(vocab)
    weights["markov_head.markov_w2.weight"] = mx.array(table)
    mx.save_safetensors(str(file), weights, metadata={"format": "pt"})
    return Path(out_dir)


def successor_table(model, tokenizer, prompts, max_tokens: int, vocab: int) -> np.ndarray:
    """What followed each token in the target's greedy continuations of `prompts` (else the token itself):
    the table `make_markov_dspark` drafts from."""
    from .checks import reference, without_eos

    table = np.arange(vocab)
    with without_eos(tokenizer) as tok:
        for prompt in prompts:
            tokens = list(prompt) + [r.token for r in reference(model, tok, prompt, max_tokens)]
            for a, b in zip(tokens[:-1], tokens[1:]):
                table[a] = b
    return table
