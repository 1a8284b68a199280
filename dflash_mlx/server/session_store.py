"""The prompt cache on disk (``--prompt-cache-dir``): one file per cached session, written atomically.

A file is in mlx-lm's prompt-cache format (`mlx_lm.models.cache.save_prompt_cache`:
safetensors holding cache objects by class): the target's caches, then the
token ids, the drafter's context per layer (an `ArraysCache` of keys and
values each) and the checkpoint of the layers that cannot be trimmed (ring,
Gated DeltaNet; caches of their own classes rebuilt from the saved state).
The metadata holds the layout and the pair's identity (`identity`: the
format, the target's and the drafter's facts). A file that cannot be read,
is of another format or was written for another pair is skipped with a
warning and left alone (it may belong to another server). The cache decides
which sessions the directory keeps (`prompt_cache.PromptCache` deletes the
file of a session it evicts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, load_prompt_cache, save_prompt_cache

from ..models.facts import model_facts
from ..utils.io import replace_atomically

FORMAT = 1
META_KEY = "dflash_mlx_session"


def identity(model, draft) -> dict:
    """What a saved session is only valid for: this target and this drafter (their facts)."""
    return {
        "format": FORMAT,
        "target": model_facts(model),
        "draft": model_facts(getattr(draft, "drafter", draft)) if draft is not None else None,
    }


def _arrays(items: list) -> ArraysCache:
    cache = ArraysCache(len(items))
    for i, item in enumerate(items):
        cache[i] = item
    return cache


def _items(cache: ArraysCache) -> list:
    return [cache[i] for i in range(len(cache.cache))]


class SessionStore:
    def __init__(self, folder: Path, key: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.key = json.loads(json.dumps(key, default=str))
        self._prefix = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:12]

    def save(self, session, name: str | None = None) -> str:
        """Write `session` (over its file `name`, else a new one); returns the file name."""
        name = name or f"{self._prefix}-{uuid.uuid4().hex[:16]}.safetensors"
        saved = session.saved()
        cache = list(saved["cache"])
        layout = {
            "key": self.key,
            "target": len(cache),
            "draft": None,
            "checkpoint": None,
            "prompt_length": saved["prompt_length"],
        }
        cache.append(_arrays([mx.array(saved["tokens"], mx.int32)]))
        if saved["draft"] is not None:  # an empty layer gets a placeholder (a cache's state cannot be empty)
            layout["draft"] = [meta for _, meta in saved["draft"]]
            cache += [_arrays(arrays or [mx.zeros((0,))]) for arrays, _ in saved["draft"]]
        if saved["checkpoint"] is not None:
            position, states = saved["checkpoint"]
            layers = [i for i, state in enumerate(states) if state is not None]
            layout["checkpoint"] = {"position": position, "layers": layers}
            cache += [type(saved["cache"][i]).from_state(states[i]) for i in layers]
        metadata = {META_KEY: json.dumps(layout)}
        try:
            replace_atomically(
                self.folder / name, lambda tmp: save_prompt_cache(str(tmp), cache, metadata), suffix=".tmp.safetensors"
            )
        except (OSError, ValueError) as e:
            logging.warning("Prompt cache: cannot write %s: %s", self.folder / name, e)
        return name

    def delete(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)

    def load(self, make) -> list:
        """(name, session) of every valid file of this pair, oldest first; `make()` gives empty sessions."""
        out = []
        files = sorted(self.folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        for path in files:
            if path.name.startswith("."):
                continue
            try:
                session = self._read(path, make)
            except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, never fatal
                logging.warning("Prompt cache: ignoring %s (%s: %s)", path, type(e).__name__, e)
                continue
            if session is not None:
                out.append((path.name, session))
        return out

    def _read(self, path: Path, make):
        tic = time.perf_counter()
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
        layout = json.loads(metadata[META_KEY])
        if layout.get("key") != self.key:
            logging.warning("Prompt cache: ignoring %s: it was saved for another model, drafter or format", path)
            return None
        n = layout["target"]
        target, rest = cache[:n], cache[n:]
        tokens = [int(t) for t in _items(rest[0])[0].tolist()]
        rest = rest[1:]
        draft = None
        if layout["draft"] is not None:
            k = len(layout["draft"])
            draft = [([a for a in _items(c) if a.size], meta) for c, meta in zip(rest[:k], layout["draft"])]
            rest = rest[k:]
        checkpoint = None
        if layout["checkpoint"] is not None:
            states = [None] * n
            for i, c in zip(layout["checkpoint"]["layers"], rest):
                states[i] = c.state
            checkpoint = (int(layout["checkpoint"]["position"]), states)
        session = make()
        session.restore(tokens, target, checkpoint, draft, int(layout.get("prompt_length", 0)))
        mx.eval([c.state for c in target], session.proposer.state() if session.proposer is not None else [])
        logging.info("Prompt cache: %s (%d tokens) loaded in %.2f s", path.name, len(tokens), time.perf_counter() - tic)
        return session
