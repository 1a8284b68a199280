"""Tiny targets whose checkpoints keep multi-token-prediction (MTP) heads, as the families ship them.

``make_mtp_target(out_dir, family)`` writes a random mlx-lm target of one of
``MTP_FAMILIES`` with ``mtp_layers`` MTP stages under the family's own names
(``mtp.*`` for qwen3_5 / qwen3_next, ``model.layers.{N}.*`` for deepseek_v3 /
deepseek_v32 / glm4_moe / glm4_moe_lite, ``model.mtp_layers.{i}.*`` for mimo) in the layout
of the original Hugging Face checkpoints, where those heads live: experts one
tensor each, DeepSeek-style attention's ``kv_b_proj`` whole, Qwen norms
zero-centred (the model scales by 1 + w), Gated DeltaNet convolutions
[C, 1, K], qwen3_5 under ``model.language_model``. mlx-lm's own sanitize turns
the target's tensors into its layout on load and drops the MTP ones, so
``mlx_lm.load`` loads the directory as it would the real checkpoint (a
qwen3_next file in mlx-lm's own layout with MTP tensors would not load).
``quantize_bits`` writes mlx-lm's layout instead (as a conversion that kept
the heads would), the target and the heads quantized alike. ``with_mtp=False``
keeps the config's MTP count and drops the tensors, as community conversions
do. ``deepseek_v3`` has 61 small layers (mlx-lm drops ``model.layers.61``
only); the others 4, hidden 64.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .builders import _LOGIT_STD, _extra_init, _init_tensor, _normal
from .families import target_config
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, TINY_VOCAB, make_tokenizer, write_json

MTP_FAMILIES = ("qwen3_5", "qwen3_next", "glm4_moe", "glm4_moe_lite", "mimo", "deepseek_v3", "deepseek_v32")
QWEN = ("qwen3_5", "qwen3_next")
MLA = ("deepseek_v3", "deepseek_v32", "glm4_moe_lite")  # attention with kv_b_proj split by mlx-lm's sanitize
QWEN_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight")
QWEN_NORMS += (".q_norm.weight", ".k_norm.weight")
STAGE_NAMES = {  # role -> (qwen, deepseek/glm, mimo) names, as mtp.layouts has them
    "projection": ("fc", "eh_proj", "input_proj"),
    "embedding_norm": ("pre_fc_norm_embedding", "enorm", "token_layernorm"),
    "hidden_norm": ("pre_fc_norm_hidden", "hnorm", "hidden_layernorm"),
    "final_norm": ("norm", "shared_head.norm", "final_layernorm"),
}


def _base(hidden_size: int, num_layers: int) -> dict:
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )


def _moe() -> dict:
    """DeepSeek-style routed experts (deepseek_v3, glm4_moe, glm4_moe_lite)."""
    return dict(
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


def mtp_config(family: str, *, mtp_layers: int = 1, hidden_size: int = 64) -> dict:
    """config.json of a tiny MTP target (the MTP count under the family's field)."""
    if family not in MTP_FAMILIES:
        raise ValueError(f"unknown MTP family {family!r}; expected one of {MTP_FAMILIES}")
    if family in QWEN:
        config = target_config(family, hidden_size=hidden_size)
        text = config.get("text_config", config)
        text["mtp_num_hidden_layers" if family == "qwen3_5" else "num_nextn_predict_layers"] = mtp_layers
        return config
    layers = 61 if family == "deepseek_v3" else 4
    config = dict(_base(hidden_size, layers), model_type=family, num_nextn_predict_layers=mtp_layers)
    if family == "mimo":
        config.update(architectures=["MiMoForCausalLM"], hidden_act="silu")
    elif family == "glm4_moe":
        config.update(architectures=["Glm4MoeForCausalLM"], **_moe())
        config.update(head_dim=16, use_qk_norm=True, attention_bias=False, partial_rotary_factor=0.5, rope_scaling=None)
    else:  # MLA attention: deepseek_v3, deepseek_v32 (with its indexer), glm4_moe_lite
        arch = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
        arch = arch.get(family, "Glm4MoeLiteForCausalLM")
        if family == "deepseek_v32":  # (top-k above any test's context: the indexer selects every key)
            config.update(index_head_dim=16, index_n_heads=4, index_topk=4096)
        config.update(architectures=[arch], **_moe())
        config.update(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        config.update(num_key_value_heads=4, attention_bias=False, rope_scaling=None)
    return config


def _random(family: str, seed: int, name: str, shape, head_std: float, hidden: int):
    if family in QWEN:
        return _extra_init(family, seed, name, shape, head_std, hidden)
    if name.endswith("e_score_correction_bias"):
        return _normal(seed, name, shape, 0.02)
    return _init_tensor(seed, name, shape, head_std)


def _template(model) -> int:
    """The last full-attention layer: the kind every family's MTP layer is."""
    return max(i for i, layer in enumerate(model.layers) if not getattr(layer, "is_linear", False))


def _mtp_stage(model, family: str, stage: int, seed: int, head_std: float) -> tuple[dict, dict]:
    """Stage `stage`'s tensors (mlx-lm layout): (own tensors by role, its decoder layer's)."""
    from dflash_mlx.targets.families import text_model

    args = text_model(model).args
    k = _template(model)
    cls = type(model.layers[k])
    layer = cls(args, k) if family != "mimo" else cls(args)
    h = args.hidden_size
    layer_weights = {
        n: mx.array(_random(family, seed, f"mtp{stage}.{n}", p.shape, head_std, h))
        for n, p in tree_flatten(layer.parameters())
    }
    own = {
        "projection": {"weight": mx.array(_normal(seed, f"mtp{stage}.proj", (h, 2 * h), (2 * h) ** -0.5))},
        "embedding_norm": {"weight": mx.array(1.0 + _normal(seed, f"mtp{stage}.enorm", (h,), 0.05))},
        "hidden_norm": {"weight": mx.array(1.0 + _normal(seed, f"mtp{stage}.hnorm", (h,), 0.05))},
        "final_norm": {"weight": mx.array(1.0 + _normal(seed, f"mtp{stage}.norm", (h,), 0.05))},
    }
    if family in ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite"):
        own["head"] = {"weight": mx.array(_normal(seed, f"mtp{stage}.head", (args.vocab_size, h), head_std))}
    return own, layer_weights


def _stage_names(family: str, stage: int, layers: int, own: dict, layer: dict) -> dict:
    """Stage tensors under the family's checkpoint names (mlx-lm layout)."""
    style = 0 if family in QWEN else (2 if family == "mimo" else 1)
    if style == 0:
        root, layer_root = "mtp.", f"mtp.layers.{stage}."
    elif style == 1:
        root = layer_root = f"model.layers.{layers + stage}."
    else:
        root = layer_root = f"model.mtp_layers.{stage}."
    names = {"head": "shared_head.head", **{role: n[style] for role, n in STAGE_NAMES.items()}}
    out = {f"{root}{names[role]}.{p}": v for role, params in own.items() for p, v in params.items()}
    out.update({layer_root + n: v for n, v in layer.items()})
    return out


def _zero_centred(name: str, v) -> bool:
    """Qwen norms the original checkpoints store as w (the model scales by 1 + w): the ones mlx-lm's sanitize
    shifts, and the MTP stage's own norms."""
    if v.ndim != 1:
        return False
    own = name.startswith("mtp.") and not name.startswith("mtp.layers.")  # (the stage's 1-D tensors: its norms)
    return own or name.endswith(QWEN_NORMS)


def _hf_layout(family: str, weights: dict) -> dict:
    """mlx-lm layout -> the original checkpoints' (the inverse of each family's sanitize)."""
    out = {}
    for name, v in weights.items():
        if ".switch_mlp." in name:  # stacked experts -> one tensor each
            head, tail = name.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{head}.experts.{e}.{tail}"] = v[e]
            continue
        if name.endswith("self_attn.unembed_out.weight"):
            continue
        if name.endswith("self_attn.embed_q.weight"):  # MLA: embed_q + unembed_out -> kv_b_proj
            wk, wv = v, weights[name.replace("embed_q", "unembed_out")]
            kv = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
            out[name.replace("embed_q", "kv_b_proj")] = kv.reshape(-1, kv.shape[-1])
            continue
        if family in QWEN and "conv1d.weight" in name:
            v = v.swapaxes(1, 2)
        if family in QWEN and _zero_centred(name, v):
            v = v - 1.0  # the model scales by 1 + w
        if family == "qwen3_5":
            name = name.replace("language_model.model.", "model.language_model.")
            name = name.replace("language_model.lm_head.", "lm_head.")
        out[name] = v
    return out


def make_mtp_target(
    out_dir: Path,
    family: str,
    *,
    seed: int = 0,
    mtp_layers: int = 1,
    quantize_bits: int | None = None,
    quantize_group_size: int = 32,
    with_mtp: bool = True,
    hidden_size: int = 64,
) -> Path:
    """Write a random target of `family` with MTP heads to `out_dir` (see the module docstring)."""
    from mlx_lm.utils import _get_classes, quantize_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = mtp_config(family, mtp_layers=mtp_layers, hidden_size=hidden_size)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    text = config.get("text_config", config)
    head_std = _LOGIT_STD / text["hidden_size"] ** 0.5
    weights = {
        n: mx.array(_random(family, seed, n, p.shape, head_std, text["hidden_size"]))
        for n, p in tree_flatten(model.parameters())
    }
    model.load_weights(list(weights.items()), strict=True)
    stages = {}
    if with_mtp:
        for i in range(mtp_layers):
            own, layer = _mtp_stage(model, family, i, seed + 1 + i, head_std)
            if quantize_bits is not None:
                layer, own = _quantized(model, layer, own, quantize_bits, quantize_group_size)
            stages.update(_stage_names(family, i, text["num_hidden_layers"], own, layer))
            if family != "mimo" and family not in QWEN:  # deepseek and glm keep a copy of the embedding
                embed = weights["model.embed_tokens.weight"]
                stages[f"model.layers.{text['num_hidden_layers'] + i}.embed_tokens.weight"] = embed
    if quantize_bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, quantize_group_size, quantize_bits)
        tensors = {**dict(tree_flatten(model.parameters())), **stages}
    else:
        tensors = _hf_layout(family, {**weights, **stages})
    mx.save_safetensors(str(out_dir / "model.safetensors"), tensors, metadata={"format": "pt"})
    write_json(out_dir / "config.json", config)
    make_tokenizer(out_dir, add_bos=config.get("bos_token_id") == BOS_ID)
    return out_dir


def _quantized(model, layer: dict, own: dict, bits: int, group_size: int) -> tuple[dict, dict]:
    """The stage's layer and projection quantized as mlx-lm quantizes the target's linear layers."""
    from dflash_mlx.targets.families import text_model

    args = text_model(model).args
    k = _template(model)
    module = type(model.layers[k])(args, k)
    module.load_weights(list(layer.items()))
    proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
    proj.weight = own["projection"]["weight"]
    holder = nn.Module()
    holder.layer, holder.proj = module, proj

    def predicate(path, m):
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0 and not path.endswith("gate")

    nn.quantize(holder, group_size=group_size, bits=bits, class_predicate=predicate)
    flat = dict(tree_flatten(holder.parameters()))
    layer = {n[len("layer.") :]: v for n, v in flat.items() if n.startswith("layer.")}
    own = dict(own, projection={n[len("proj.") :]: v for n, v in flat.items() if n.startswith("proj.")})
    return layer, own


def mtp_stage_reference(model, family: str, stage: int = 0, seed: int = 0) -> tuple[dict, dict]:
    """What ``make_mtp_target(..., seed=seed)`` wrote for a stage, in mlx-lm's layout and as the model computes
    with it (norms as scales): ({role: {param: array}}, {layer parameter: array}), for a loaded ``model``."""
    from dflash_mlx.targets.families import text_model

    head_std = _LOGIT_STD / text_model(model).args.hidden_size ** 0.5
    return _mtp_stage(model, family, stage, seed + 1 + stage, head_std)
