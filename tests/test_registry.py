"""models.toml registry: parsing, lookups, validation errors, README table sync."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from helpers import ALL_FAMILIES as TINY_FAMILIES
from helpers.architectures import ARCHITECTURES
from dflash_mlx.models.registry import (
    KINDS,
    PUBLISHERS,
    RegistryEntry,
    RegistryError,
    load_registry,
    lookup,
    parse_registry,
    registry_entries,
)

ROOT = Path(__file__).resolve().parent.parent

GOOD_ENTRY = """
[[pair]]
name = "tiny"
target = "acme/Tiny-1B"
mlx_targets = ["mlx-community/Tiny-1B-4bit"]
draft = "acme/Tiny-1B-DFlash"
block_size = 8
family = "qwen3"
kind = "dflash"
publisher = "authors"
notes = "test entry"
"""


def test_packaged_registry_parses():
    entries = registry_entries()
    assert len(entries) >= 10
    assert all(isinstance(e, RegistryEntry) for e in entries)
    assert len({e.name for e in entries}) == len(entries)
    assert all(e.kind in KINDS and e.block_size >= 2 for e in entries)


def test_every_registered_family_runs_in_the_tests():
    """A pair stays in the registry only if its family's tiny target runs DFlash losslessly in the tests
    (tests/test_architectures.py and the tiny families of test_lossless / test_hybrid_sliding), and every
    registered target's source is cited in models.toml."""
    tested = set(ARCHITECTURES) | set(TINY_FAMILIES) | {"gpt_oss", "gemma4", "qwen3_5", "qwen3_5_moe", "qwen3_next"}
    entries = registry_entries()
    assert {e.family for e in entries} <= tested
    assert {"gemma-4-31b-it", "minimax-m2.5", "kimi-k2.5"} <= {e.name for e in entries}
    text = (ROOT / "models.toml").read_text()
    assert text.count("# source") >= 4 and "https://github.com/z-lab/dflash" in text
    big = {e.name for e in entries if e.needs_shard}
    assert {"kimi-k2.5", "minimax-m2.5", "qwen3.5-122b-a10b"} <= big and "qwen3-4b" not in big
    assert lookup("minimax-m2.5").memory_note == "needs --shard or a quantized target (bf16 ~458 GB)"


def test_known_pair_fields():
    entry = lookup("qwen3-4b")
    assert entry == RegistryEntry(
        name="qwen3-4b",
        target="Qwen/Qwen3-4B",
        draft="z-lab/Qwen3-4B-DFlash-b16",
        block_size=16,
        kind="dflash",
        publisher="authors",
        family="qwen3",
        mlx_targets=(
            "mlx-community/Qwen3-4B-bf16",
            "mlx-community/Qwen3-4B-8bit",
            "mlx-community/Qwen3-4B-4bit",
        ),
        notes="trained on non-thinking replies",
        reasoning="enable_thinking",
        reasoning_default="off",
    )
    assert lookup("gpt-oss-20b").reasoning_values == ("low", "medium", "high")
    llama = lookup("llama3.1-8b-instruct")
    assert llama.block_size == 10
    assert llama.draft == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    assert "dspark" in {e.kind for e in registry_entries()} and {e.kind for e in registry_entries()} <= set(KINDS)
    assert {e.publisher for e in registry_entries() if not e.bundled} <= set(PUBLISHERS)
    dspark = lookup("qwen3-14b")
    assert (dspark.kind, dspark.publisher, dspark.draft) == ("dspark", "authors", "deepseek-ai/dspark_qwen3_14b_block7")
    assert lookup("Qwen/Qwen3.8-27B").publisher == "community"


@pytest.mark.parametrize(
    "key",
    [
        "qwen3-4b",
        "QWEN3-4B",
        "Qwen/Qwen3-4B",
        "qwen/qwen3-4b",
        "mlx-community/Qwen3-4B-4bit",
        "MLX-COMMUNITY/qwen3-4b-bf16",
        "  qwen3-4b ",
    ],
)
def test_lookup_by_name_target_and_mlx_target(key):
    entry = lookup(key)
    assert entry is not None and entry.name == "qwen3-4b"
    assert entry.draft == "z-lab/Qwen3-4B-DFlash-b16"


def test_lookup_unknown_returns_none():
    assert lookup("no-such-model") is None
    assert lookup("Qwen/Qwen3-4B-Base") is None
    assert lookup("acme/unknown") is None


def test_every_alias_resolves_to_its_entry():
    for entry in registry_entries():
        for alias in entry.aliases:
            assert lookup(alias) == entry
        if not entry.bundled:  # bundled entries are found by name only
            assert lookup(entry.target).draft == entry.draft


def test_load_registry_from_file(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(GOOD_ENTRY, encoding="utf-8")
    (entry,) = load_registry(path)
    assert entry.name == "tiny" and entry.mlx_targets == ("mlx-community/Tiny-1B-4bit",)
    with pytest.raises(AttributeError):
        entry.name = "other"  # frozen


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("block_size = 8", 'block_size = "8"', "block_size"),
        ("block_size = 8", "block_size = 1", "block_size"),
        ('kind = "dflash"', 'kind = "eagle"', "kind"),
        ('publisher = "authors"', 'publisher = "someone"', "publisher"),
        ('publisher = "authors"\n', "", "publisher"),
        ('draft = "acme/Tiny-1B-DFlash"', 'draft = "not a repo"', "draft"),
        ('draft = "acme/Tiny-1B-DFlash"\n', "", "draft"),
        ('family = "qwen3"', "family = 3", "family"),
        ('mlx_targets = ["mlx-community/Tiny-1B-4bit"]', 'mlx_targets = "x/y"', "mlx_targets"),
        ('notes = "test entry"', 'nots = "typo"', "nots"),
        ('notes = "test entry"', 'reasoning = "thinking"', "reasoning"),
        ('notes = "test entry"', 'reasoning = "reasoning_effort"\nreasoning_values = []', "reasoning_values"),
        ('notes = "test entry"', 'reasoning_values = ["low"]', "reasoning"),
        ('notes = "test entry"', 'reasoning = "enable_thinking"\nreasoning_values = ["a"]', "reasoning_values"),
        (
            'notes = "test entry"',
            'reasoning = "reasoning_effort"\nreasoning_values = ["low"]\nreasoning_default = "high"',
            "reasoning_default",
        ),
        ('notes = "test entry"', 'bundled = "yes"', "bundled"),
        ('target = "acme/Tiny-1B"', 'target = "../outside"\nbundled = true', "target"),
    ],
)
def test_malformed_entry_names_file_entry_and_field(tmp_path, old, new, field):
    assert old in GOOD_ENTRY
    path = tmp_path / "models.toml"
    path.write_text(GOOD_ENTRY.replace(old, new), encoding="utf-8")
    with pytest.raises(RegistryError) as info:
        load_registry(path)
    message = str(info.value)
    assert str(path) in message
    assert "[[pair]] #1" in message and "'tiny'" in message
    assert repr(field) in message


def test_malformed_file_level_errors(tmp_path):
    with pytest.raises(RegistryError, match="invalid TOML"):
        parse_registry("[[pair]\nname = ", "broken.toml")
    with pytest.raises(RegistryError, match="at least one"):
        parse_registry("", "empty.toml")
    with pytest.raises(RegistryError, match="unknown top-level key 'pairs'"):
        parse_registry(GOOD_ENTRY.replace("[[pair]]", "[[pairs]]"), "x.toml")
    duplicate = GOOD_ENTRY + GOOD_ENTRY.replace('name = "tiny"', 'name = "tiny2"')
    pattern = r"#2 \(name 'tiny2'\): field 'target': .* #1 \(name 'tiny'\)"
    with pytest.raises(RegistryError, match=pattern):
        parse_registry(duplicate, "dup.toml")
    with pytest.raises(RegistryError, match="cannot read"):
        load_registry(tmp_path / "missing.toml")


def test_packaged_models_toml_equals_top_level():
    packaged = resources.files("dflash_mlx").joinpath("models.toml").read_bytes()
    assert packaged == (ROOT / "models.toml").read_bytes()


def _gen(*args: str) -> subprocess.CompletedProcess:
    script = ROOT / "scripts" / "gen_model_table.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)


def test_readme_models_table_is_in_sync():
    result = _gen("--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_gen_model_table_check_and_rewrite(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- models:start -->\nstale\n<!-- models:end -->\ntail\n")
    assert _gen("--check", "--readme", str(readme)).returncode == 1
    assert "stale" in readme.read_text()
    assert _gen("--readme", str(readme)).returncode == 0
    text = readme.read_text()
    assert "stale" not in text and "`z-lab/Qwen3-4B-DFlash-b16`" in text
    assert text.startswith("# x\n") and text.endswith("<!-- models:end -->\ntail\n")
    assert _gen("--check", "--readme", str(readme)).returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]  # no temp file left


def test_gen_model_table_reports_bad_registry(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text(GOOD_ENTRY.replace("block_size = 8", "block_size = 0"))
    result = _gen("--check", "--models", str(bad))
    assert result.returncode == 2
    assert "'block_size'" in result.stderr and str(bad) in result.stderr
