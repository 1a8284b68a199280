"""The registry of known target -> drafter pairs (``models.toml``).

Owns the schema of models.toml: parsing it with ``tomllib``, validating each
``[[pair]]`` entry (errors name the file, the entry and the field) and the
lookups ``registry_entries`` and ``lookup``. The packaged copy
(``dflash_mlx/models.toml``) is read through ``importlib.resources``.

Stdlib only and free of package-relative imports, so that
``scripts/gen_model_table.py`` can load this file without importing MLX.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS",
    "PUBLISHERS",
    "RegistryEntry",
    "RegistryError",
    "load_registry",
    "lookup",
    "is_repo_id",
    "parse_registry",
    "registry_entries",
]

KINDS = ("dflash", "dflash2", "dspark")
PUBLISHERS = ("authors", "vendor", "community")  # who published the drafter: the method's authors, the
# target's vendor, or a third party with a public page
LARGEST_MAC_GB = 192  # unified memory of the largest Mac: a bf16 target above it needs --shard or quantizing
REASONING_KEYS = ("enable_thinking", "reasoning_effort", "reasoning_strength")
PACKAGE = "dflash_mlx"
RESOURCE = "models.toml"

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class RegistryError(ValueError):
    """models.toml is unreadable or an entry in it is invalid."""


@dataclass(frozen=True)
class RegistryEntry:
    """One target -> drafter pair."""

    name: str
    target: str
    draft: str
    block_size: int
    kind: str
    publisher: str | None = None  # one of PUBLISHERS (required in models.toml but for the bundled pair)
    family: str | None = None
    mlx_targets: tuple[str, ...] = ()
    notes: str = ""
    reasoning: str | None = None  # the chat template's switch: one of REASONING_KEYS
    reasoning_values: tuple[str, ...] = ()
    reasoning_default: str | None = None  # applied when the user passes no --reasoning
    bundled: bool = False  # target and draft are directories inside the package
    target_params_b: float | None = None  # the target's parameters, in billions (its bf16 size: 2 bytes each)

    @property
    def needs_shard(self) -> bool:
        """Whether the target's bf16 weights exceed the largest Mac's memory."""
        return self.target_params_b is not None and 2 * self.target_params_b > LARGEST_MAC_GB

    @property
    def memory_note(self) -> str:
        """What a user must do about the target's size ("" when it fits)."""
        if not self.needs_shard:
            return ""
        return f"needs --shard or a quantized target (bf16 ~{2 * self.target_params_b:.0f} GB)"

    def target_path(self) -> str:
        """What to load the target from: its repo id, or the packaged directory."""
        return str(resources.files(PACKAGE).joinpath(self.target)) if self.bundled else self.target

    def draft_path(self) -> str:
        return str(resources.files(PACKAGE).joinpath(self.draft)) if self.bundled else self.draft

    @property
    def aliases(self) -> tuple[str, ...]:
        """Every string ``lookup`` matches (case-insensitively) for this entry."""
        if self.bundled:
            return (self.name,)
        return (self.name, self.target, *self.mlx_targets)


# --- validation -------------------------------------------------------------


def _check_name(value: Any) -> str | None:
    if isinstance(value, str) and _NAME_RE.match(value):
        return None
    return "expected a short lowercase name (letters, digits, '.', '-')"


def is_repo_id(text: str) -> bool:
    """Whether `text` has the shape of a Hugging Face repo id, 'owner/name'."""
    return isinstance(text, str) and bool(_REPO_RE.match(text))


def _check_repo(value: Any) -> str | None:
    if is_repo_id(value):
        return None
    return "expected a Hugging Face repo id 'owner/name'"


def _check_block(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
        return None
    return "expected an integer >= 2 (the block counts the anchor)"


def _check_kind(value: Any) -> str | None:
    if value in KINDS:
        return None
    return f"expected one of {', '.join(repr(k) for k in KINDS)}"


def _check_publisher(value: Any) -> str | None:
    if value in PUBLISHERS:
        return None
    return f"expected one of {', '.join(repr(p) for p in PUBLISHERS)} (who published the drafter)"


def _check_family(value: Any) -> str | None:
    if isinstance(value, str) and re.match(r"^[a-z0-9_]+$", value):
        return None
    return "expected an mlx-lm model_type such as 'qwen3' or 'gpt_oss'"


def _check_repo_list(value: Any) -> str | None:
    if isinstance(value, list) and all(_check_repo(v) is None for v in value):
        return None
    return "expected a list of Hugging Face repo ids 'owner/name'"


def _check_notes(value: Any) -> str | None:
    return None if isinstance(value, str) else "expected a string"


def _check_reasoning(value: Any) -> str | None:
    if value in REASONING_KEYS:
        return None
    return f"expected one of {', '.join(REASONING_KEYS)}"


def _check_levels(value: Any) -> str | None:
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return None
    return 'expected a non-empty list of strings such as ["low", "medium", "high"]'


def _check_bool(value: Any) -> str | None:
    return None if isinstance(value, bool) else "expected true or false"


def _check_billions(value: Any) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return None
    return "expected a positive number (billions of parameters)"


# field -> (required, checker)
_FIELDS = {
    "name": (True, _check_name),
    "target": (True, _check_repo),
    "draft": (True, _check_repo),
    "block_size": (True, _check_block),
    "kind": (True, _check_kind),
    "publisher": (True, _check_publisher),
    "family": (False, _check_family),
    "mlx_targets": (False, _check_repo_list),
    "notes": (False, _check_notes),
    "reasoning": (False, _check_reasoning),
    "reasoning_values": (False, _check_levels),
    "reasoning_default": (False, _check_notes),
    "bundled": (False, _check_bool),
    "target_params_b": (False, _check_billions),
}


def _check_bundled_path(value: Any) -> str | None:
    if isinstance(value, str) and value and not value.startswith("/") and ".." not in value.split("/"):
        return None
    return "expected a directory path inside the dflash_mlx package (bundled = true)"


def _entry_label(index: int, table: Any) -> str:
    name = table.get("name") if isinstance(table, dict) else None
    label = f"[[pair]] #{index}"
    return f"{label} (name {name!r})" if isinstance(name, str) else label


def _parse_entry(source: str, index: int, table: Any) -> RegistryEntry:
    where = f"{source}: {_entry_label(index, table)}"
    if not isinstance(table, dict):
        raise RegistryError(f"{where}: expected a table")
    for key in table:
        if key not in _FIELDS:
            known = ", ".join(_FIELDS)
            raise RegistryError(f"{where}: unknown field {key!r} (known: {known})")
    for key, (required, check) in _FIELDS.items():
        if key not in table:
            if required and not (key == "publisher" and table.get("bundled") is True):
                raise RegistryError(f"{where}: missing required field {key!r}")
            continue
        if key in ("target", "draft") and table.get("bundled") is True:
            check = _check_bundled_path
        problem = check(table[key])
        if problem:
            raise RegistryError(f"{where}: field {key!r}: {problem}, got {table[key]!r}")
    _check_reasoning_fields(where, table)
    return RegistryEntry(
        name=table["name"],
        target=table["target"],
        draft=table["draft"],
        block_size=table["block_size"],
        kind=table["kind"],
        publisher=table.get("publisher"),
        family=table.get("family"),
        mlx_targets=tuple(table.get("mlx_targets", ())),
        notes=table.get("notes", ""),
        reasoning=table.get("reasoning"),
        reasoning_values=tuple(table.get("reasoning_values", ())),
        reasoning_default=table.get("reasoning_default"),
        bundled=table.get("bundled", False),
        target_params_b=table.get("target_params_b"),
    )


def _check_reasoning_fields(where: str, table: dict) -> None:
    key, values, default = table.get("reasoning"), table.get("reasoning_values"), table.get("reasoning_default")
    if (values or default) and not key:
        raise RegistryError(f"{where}: field 'reasoning' is required with reasoning_values / reasoning_default")
    if key == "enable_thinking" and values:
        raise RegistryError(f"{where}: field 'reasoning_values': enable_thinking takes only on/off")
    allowed = ("on", "off") if key == "enable_thinking" else tuple(values or ())
    if default is not None and allowed and default not in allowed:
        raise RegistryError(
            f"{where}: field 'reasoning_default': expected one of {', '.join(allowed)}, got {default!r}"
        )


def parse_registry(text: str, source: str = RESOURCE) -> list[RegistryEntry]:
    """Parse and validate the text of a models.toml; ``source`` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{source}: invalid TOML: {exc}") from exc
    extra = [key for key in data if key != "pair"]
    if extra:
        raise RegistryError(f"{source}: unknown top-level key {extra[0]!r} (only [[pair]] tables)")
    tables = data.get("pair")
    if not isinstance(tables, list) or not tables:
        raise RegistryError(f"{source}: expected at least one [[pair]] table")
    entries = [_parse_entry(source, i, t) for i, t in enumerate(tables, start=1)]
    seen: dict[str, tuple[int, str]] = {}  # lowercased alias -> (index, its entry's name)
    for index, entry in enumerate(entries, start=1):
        for field, alias in _alias_fields(entry):
            key = alias.lower()
            if key in seen and seen[key][0] != index:
                other, other_name = seen[key]
                raise RegistryError(
                    f"{source}: {_entry_label(index, {'name': entry.name})}: field {field!r}: "
                    f"{alias!r} is already used by {_entry_label(other, {'name': other_name})}"
                )
            seen[key] = (index, entry.name)
    return entries


def _alias_fields(entry: RegistryEntry) -> list[tuple[str, str]]:
    if entry.bundled:
        return [("name", entry.name)]
    pairs = [("name", entry.name), ("target", entry.target)]
    return pairs + [("mlx_targets", m) for m in entry.mlx_targets]


def load_registry(path: str | Path) -> list[RegistryEntry]:
    """Read and validate a models.toml file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read: {exc}") from exc
    return parse_registry(text, str(path))


# --- the packaged registry ----------------------------------------------------


@lru_cache(maxsize=1)
def _packaged() -> tuple[RegistryEntry, ...]:
    resource = resources.files(PACKAGE).joinpath(RESOURCE)
    try:
        text = resource.read_text(encoding="utf-8")
    except OSError as exc:
        raise RegistryError(f"{PACKAGE}/{RESOURCE}: cannot read: {exc}") from exc
    return tuple(parse_registry(text, f"{PACKAGE}/{RESOURCE}"))


def registry_entries() -> list[RegistryEntry]:
    """All entries of the packaged models.toml, in file order."""
    return list(_packaged())


def lookup(name_or_repo: str) -> RegistryEntry | None:
    """The entry whose name, target id or an MLX conversion id matches (any case).

    Returns None for unknown names; the caller decides how to fail.
    """
    key = name_or_repo.strip().lower()
    for entry in _packaged():
        if any(key == alias.lower() for alias in entry.aliases):
            return entry
    return None
