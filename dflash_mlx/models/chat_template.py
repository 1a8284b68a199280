"""Chat templating and the `--reasoning` switch.

Models switch reasoning through their chat template, each with its own key:
`enable_thinking` (Qwen3 / Qwen3.5: on or off), `reasoning_effort` (gpt-oss:
low / medium / high) or `reasoning_strength`. `reasoning_kwargs` maps one
user-facing level onto the key the template actually reads (found in the
template source, or given by the registry entry), validates the level, and
fails with a clear message when the template has no such key;
`reasoning_switches` lists every level's arguments for the server, which maps
requests' thinking / reasoning fields onto them. `render` applies the template
exactly as `mlx_lm generate` does (text, then mlx-lm's encoding).
"""

from __future__ import annotations

import re

from ..models.registry import REASONING_KEYS, RegistryEntry

LEVELS = ("on", "off", "low", "medium", "high", "xhigh")
_KNOWN_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ReasoningError(ValueError):
    """A --reasoning value the model's chat template cannot take."""


def template_source(tokenizer) -> str | None:
    """The tokenizer's chat template text (None when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template.strip() else None


def reasoning_key(tokenizer, entry: RegistryEntry | None = None) -> str | None:
    """The reasoning switch the template reads (the registry's word wins)."""
    if entry is not None and entry.reasoning:
        return entry.reasoning
    source = template_source(tokenizer) or ""
    return next((key for key in REASONING_KEYS if re.search(rf"\b{key}\b", source)), None)


def reasoning_levels(tokenizer, key: str, entry: RegistryEntry | None = None) -> tuple[str, ...]:
    """The levels `key` takes: registry values, else the level names the template compares against."""
    if key == "enable_thinking":
        return ("on", "off")
    if entry is not None and entry.reasoning_values:
        return entry.reasoning_values
    source = template_source(tokenizer) or ""
    found = tuple(v for v in _KNOWN_EFFORTS if re.search(rf"['\"]{v}['\"]", source))
    return found or ("low", "medium", "high")


def reasoning_kwargs(
    tokenizer, level: str | None, entry: RegistryEntry | None = None, model_name: str = "the model"
) -> dict:
    """Template keyword arguments for `--reasoning level` (None: the registry default, if any)."""
    explicit = level is not None
    if level is None:
        level = entry.reasoning_default if entry is not None else None
        if level is None:
            return {}
    level = level.strip().lower()
    if explicit and level not in LEVELS:
        raise ReasoningError(f"--reasoning: expected one of {', '.join(LEVELS)}, got {level!r}.")
    key = reasoning_key(tokenizer, entry)
    if key is None:
        if not explicit:
            return {}
        raise ReasoningError(
            f"--reasoning {level}: the chat template of {model_name} has none of "
            f"{', '.join(REASONING_KEYS)}, so reasoning cannot be switched for it."
        )
    levels = reasoning_levels(tokenizer, key, entry)
    if key == "enable_thinking":
        if level not in ("on", "off"):
            raise ReasoningError(
                f"--reasoning {level}: {model_name} switches reasoning with enable_thinking; use on or off."
            )
        return {"enable_thinking": level == "on"}
    if level == "on":
        default = entry.reasoning_default if entry is not None else None
        return {key: default} if default else {}
    if level not in levels:
        raise ReasoningError(
            f"--reasoning {level}: {model_name} sets reasoning with {key}, which takes "
            f"{', '.join(levels)}" + ("" if level != "off" else "; it cannot be switched off") + "."
        )
    return {key: level}


def reasoning_switches(tokenizer, entry: RegistryEntry | None = None, model_name: str = "the model") -> dict:
    """Each of `LEVELS`' template arguments, or the reason the template cannot take it (a string);
    empty when the template has no reasoning switch."""
    if template_source(tokenizer) is None or reasoning_key(tokenizer, entry) is None:
        return {}
    out = {}
    for level in LEVELS:
        try:
            out[level] = reasoning_kwargs(tokenizer, level, entry, model_name)
        except ReasoningError as e:
            out[level] = str(e).split(": ", 1)[-1]  # without the "--reasoning LEVEL: " of the CLI's message
    return out


def render(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> str:
    """The prompt text for `messages`, ready for the assistant's reply."""
    if template_source(tokenizer) is None:
        raise ValueError("The tokenizer has no chat template (use a raw prompt instead).")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
