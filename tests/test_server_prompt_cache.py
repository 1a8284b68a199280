"""`dflash-mlx serve`'s prompt cache as clients see it, on the bundled pair, through `openai`.

Two conversations interleaved (A1 B1 A2 B2): the second turns report most of
their prompt as cached (``usage.prompt_tokens_details.cached_tokens``) by
default, none of it with ``--prompt-cache-size 1``, and a server restarted
on the same ``--prompt-cache-dir`` still has them (a corrupt file in the
directory is skipped with a warning). Every reply equals a cold server's
(``--prompt-cache-size 0``: nothing kept, every prompt prefilled whole).
"""

from __future__ import annotations

import pytest

from helpers.servers import ServeProcess

pytestmark = pytest.mark.slow  # servers

openai = pytest.importorskip("openai")

A1 = [{"role": "user", "content": "Tom has 3 boxes with 12 apples each. How many apples?"}]
B1 = [{"role": "user", "content": "Sara reads 5 pages a day. How many pages does she read in a week?"}]
FOLLOW_UP = {"A": "And if he gives 4 away?", "B": "And in two weeks?"}
MAX_TOKENS = 24


def _ask(client, messages):
    reply = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].message.content, reply.usage.prompt_tokens, details.cached_tokens


def _conversation(*server_args, restart_between_turns: bool = False) -> tuple[dict, str]:
    """Runs A1 B1 A2 B2; returns {turn: (text, prompt tokens, cached tokens)} and the servers' stderr."""
    out, stderr = {}, ""
    server = ServeProcess(*server_args)
    try:
        for turn in ("A1", "B1", "A2", "B2"):
            if turn == "A2" and restart_between_turns:
                assert server.stop() == 0, server.stderr
                stderr += server.stderr
                corrupt = server_args[server_args.index("--prompt-cache-dir") + 1]
                (__import__("pathlib").Path(corrupt) / "half-written.safetensors").write_bytes(b"\x00" * 7)
                server = ServeProcess(*server_args)
            name = turn[0]
            first = A1 if name == "A" else B1
            messages = (
                first
                if turn.endswith("1")
                else first
                + [{"role": "assistant", "content": out[name + "1"][0]}, {"role": "user", "content": FOLLOW_UP[name]}]
            )
            with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
                out[turn] = _ask(c, messages)
    finally:
        assert server.stop() == 0, server.stderr
        stderr += server.stderr
    return out, stderr


@pytest.fixture(scope="module")
def cold():
    return _conversation("--prompt-cache-size", "0")[0]


def test_cold_server_caches_nothing(cold):
    assert all(cached == 0 for _, _, cached in cold.values())


def test_interleaved_conversations_reuse_their_caches(cold):
    warm, _ = _conversation()
    assert [t for t, _, _ in warm.values()] == [t for t, _, _ in cold.values()]
    for turn in ("A2", "B2"):
        _, prompt_tokens, cached = warm[turn]
        first_prompt = warm[turn[0] + "1"][1]
        assert cached > first_prompt and cached > prompt_tokens // 2, (turn, warm[turn])


def test_a_cache_of_one_conversation_forgets_the_other(cold):
    small, _ = _conversation("--prompt-cache-size", "1")
    assert [t for t, _, _ in small.values()] == [t for t, _, _ in cold.values()]
    assert small["A2"][2] == 0 and small["B2"][2] == 0


def test_a_restart_with_a_prompt_cache_dir_keeps_the_conversations(cold, tmp_path):
    kept, stderr = _conversation("--prompt-cache-dir", str(tmp_path), restart_between_turns=True)
    assert [t for t, _, _ in kept.values()] == [t for t, _, _ in cold.values()]
    assert kept["A2"][2] > kept["A1"][1] and kept["B2"][2] > kept["B1"][1]
    assert "half-written.safetensors" in stderr  # skipped with a warning
