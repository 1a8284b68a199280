"""One rank of a sharded run, started by ``mlx.launch`` (tests/test_sharding.py).

``python sharded_rank.py SPEC.json``: SPEC gives the target and drafter
directories (``target`` may differ per rank: ``targets`` by rank; or
``pairs``: several {target, draft, runs}, run one after the other), the runs
(prompt ids, max tokens, block size, sampling settings, ``eos``: stop tokens) and an output
directory; every rank loads the pair with ``dflash_mlx.load(..., shard="tensor")``,
runs every generation (``"mlx_lm": true``: mlx-lm's own ``stream_generate``
on the sharded target, its plain sharded decoding) and writes ``rank<R>.json`` (its tokens per run, or the
error it raised). ``reseed_rank`` reseeds that rank after loading (a test
that the lockstep check catches diverging ranks).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path


def main(spec_path: str) -> int:
    from dflash_mlx.sharding.group import world

    spec = json.loads(Path(spec_path).read_text())
    group = world()
    rank = group.rank()
    out = Path(spec["out"]) / f"rank{rank}.json"
    result = {"rank": rank, "size": group.size(), "runs": []}
    pairs = spec.get("pairs") or [spec]
    try:
        for pair in pairs:
            run_pair(pair, rank, group.size(), spec.get("reseed_rank"), result["runs"])
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        result["error"] = {"type": type(e).__name__, "message": str(e)}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
    return 1 if "error" in result else 0


def run_pair(pair: dict, rank: int, size: int, reseed_rank, results: list) -> None:
    import mlx.core as mx

    import dflash_mlx

    target = pair.get("targets", [pair.get("target")] * size)[rank]
    model, tokenizer, draft = dflash_mlx.load(target, pair.get("draft"), shard="tensor")
    if reseed_rank == rank:
        mx.random.seed(12345 + rank)
    for run in pair["runs"]:
        kwargs = {k: v for k, v in run.items() if k not in ("prompt", "plain", "mlx_lm", "eos")}
        tok = tokenizer
        if "eos" in run:  # a copy stopping on these tokens only
            tok = copy.copy(tokenizer)
            tok.eos_token_ids = set(run["eos"])
        if run.get("mlx_lm"):
            from mlx_lm import stream_generate

            responses = stream_generate(model, tok, mx.array(run["prompt"]), **kwargs)
        else:
            responses = dflash_mlx.stream_generate(
                model, None if run.get("plain") else draft, tok, run["prompt"], **kwargs
            )
        results.append([r.token for r in responses])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
