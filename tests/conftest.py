"""Shared pytest fixtures: tiny on-disk models, built once per session.

``tiny_target(family, **kw)`` and ``tiny_draft(target_dir, **kw)`` are
memoizing factories over ``tests/tiny_models.make_target`` / ``make_draft``:
the same arguments return the same directory, so many tests share one build.
Treat the returned directories as read-only.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_models  # noqa: E402


def _key(*args, **kwargs) -> str:
    """A short stable name for an argument set (values must be JSON-able)."""
    text = json.dumps([args, kwargs], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


class _Builder:
    """Calls ``build(out_dir, *args, **kwargs)`` once per distinct arguments."""

    def __init__(self, root: Path, build, prefix: str):
        self._root, self._build, self._prefix = root, build, prefix
        self._cache: dict = {}

    def __call__(self, *args, **kwargs) -> Path:
        key = _key(*args, **kwargs)
        if key not in self._cache:
            out = self._root / f"{self._prefix}-{key}"
            self._cache[key] = self._build(out, *args, **kwargs)
        return self._cache[key]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """Factory: ``tiny_target("qwen3", dtype="bfloat16", ...) -> Path``."""
    return _Builder(tmp_path_factory.mktemp("targets"), tiny_models.make_target, "target")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """Factory: ``tiny_draft(target_dir, num_layers=2, ...) -> Path``."""
    return _Builder(tmp_path_factory.mktemp("drafts"), tiny_models.make_draft, "draft")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """Factory: ``tiny_tokenizer(add_bos=False) -> Path`` (tokenizer files only)."""

    def build(out_dir, add_bos=False):
        tiny_models.make_tokenizer(out_dir, add_bos=add_bos)
        return out_dir

    return _Builder(tmp_path_factory.mktemp("tokenizers"), build, "tok")


@pytest.fixture(scope="session")
def qwen3_target(tiny_target) -> Path:
    """The default float32 qwen3 target (4 layers, hidden 64)."""
    return tiny_target("qwen3")


@pytest.fixture(scope="session")
def qwen3_draft(tiny_draft, qwen3_target) -> Path:
    """A 2-layer nested-schema draft bound to ``qwen3_target``.

    Its target_layer_ids are [1, 2]: for a 4-layer target the spec's
    derivation rule gives [1, 1], and distinct layers catch more bugs.
    """
    return tiny_draft(qwen3_target, target_layer_ids=[1, 2])
