"""Where each family keeps its multi-token-prediction (MTP) tensors, and how its heads run.

The facts come from vLLM's per-family MTP modules (`qwen3_next_mtp.py`,
`qwen3_5_mtp.py`, `deepseek_mtp.py`, `glm4_moe_mtp.py`, `mimo_mtp.py`) and the
families' public configs. A stage i (of the config's count) is: an input
projection of [norm_e(embed(x[t+1])), norm_h(h[t])] (MiMo: hidden first), one
decoder layer of the family's own kind, a final norm, and the target's output
head or a head of its own (`shared_head.head`). Names below are relative to a
root: `stage_root(i, n)` holds the stage's own tensors (projection, norms,
head), `layer_root(i, n)` its decoder layer's (n: the target's
num_hidden_layers); a root may sit under any prefix (a conversion that nests
the text model).

Chained steps feed back the stage's output as vLLM's modules return it: before
the final norm for DeepSeek and GLM (their `shared_head` norms inside the
logits), after it for Qwen and MiMo (the norm inside their forward). vLLM also
zeroes the embedding at position 0 for DeepSeek, GLM and MiMo.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

PROJECTION, EMBEDDING_NORM, HIDDEN_NORM, FINAL_NORM, HEAD = (
    "projection",
    "embedding_norm",
    "hidden_norm",
    "final_norm",
    "head",
)
ROLES = (PROJECTION, EMBEDDING_NORM, HIDDEN_NORM, FINAL_NORM, HEAD)
NORMS = (EMBEDDING_NORM, HIDDEN_NORM, FINAL_NORM)


@dataclass(frozen=True)
class MTPLayout:
    count_field: str  # the config field (of the text config) with the number of MTP layers
    stage_root: Callable[[int, int], str]
    layer_root: Callable[[int, int], str]
    names: dict  # role -> tensor module name under stage_root (HEAD may be absent: the target's head)
    ignored: tuple[str, ...] = ()  # module names under stage_root that are not the stage's (a copy of the embedding)
    hidden_first: bool = False  # the projection's input is [norm_h(h), norm_e(e)]
    normed_feedback: bool = False  # chained steps feed back the output after the final norm
    masks_first_position: bool = False  # the embedding of the pair at position 0 is zeroed

    def count(self, config: dict) -> int:
        text = config.get("text_config", config)
        value = text.get(self.count_field, config.get(self.count_field, 0))
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


_QWEN = MTPLayout(
    count_field="num_nextn_predict_layers",
    stage_root=lambda i, n: "mtp.",
    layer_root=lambda i, n: f"mtp.layers.{i}.",
    names={
        PROJECTION: "fc",
        EMBEDDING_NORM: "pre_fc_norm_embedding",
        HIDDEN_NORM: "pre_fc_norm_hidden",
        FINAL_NORM: "norm",
    },
    normed_feedback=True,
)
_DEEPSEEK = MTPLayout(
    count_field="num_nextn_predict_layers",
    stage_root=lambda i, n: f"model.layers.{n + i}.",
    layer_root=lambda i, n: f"model.layers.{n + i}.",
    names={
        PROJECTION: "eh_proj",
        EMBEDDING_NORM: "enorm",
        HIDDEN_NORM: "hnorm",
        FINAL_NORM: "shared_head.norm",
        HEAD: "shared_head.head",
    },
    ignored=("embed_tokens",),
    masks_first_position=True,
)
_MIMO = MTPLayout(
    count_field="num_nextn_predict_layers",
    stage_root=lambda i, n: f"model.mtp_layers.{i}.",
    layer_root=lambda i, n: f"model.mtp_layers.{i}.",
    names={
        PROJECTION: "input_proj",
        EMBEDDING_NORM: "token_layernorm",
        HIDDEN_NORM: "hidden_layernorm",
        FINAL_NORM: "final_layernorm",
    },
    hidden_first=True,
    normed_feedback=True,
    masks_first_position=True,
)

LAYOUTS: dict[str, MTPLayout] = {
    "qwen3_5": replace(_QWEN, count_field="mtp_num_hidden_layers"),
    "qwen3_5_moe": replace(_QWEN, count_field="mtp_num_hidden_layers"),
    "qwen3_next": _QWEN,
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v32": _DEEPSEEK,
    "glm4_moe": _DEEPSEEK,
    "glm4_moe_lite": _DEEPSEEK,
    "mimo": _MIMO,
}


def layout_for(family: str) -> MTPLayout | None:
    return LAYOUTS.get(family)
