"""Benchmark prompts packaged with dflash-mlx (GSM8K test, HumanEval, MT-Bench, edit), and long GSM8K conversations.

The files are copies of the public datasets with their licences alongside
(LICENSE.*). Prompt formats follow upstream DFlash's benchmarks: GSM8K asks for
step-by-step reasoning and a boxed answer, HumanEval for a solution that passes
the tests, MT-Bench is multi-turn (each later turn sees the model's own earlier
replies). `edit` is a workload whose replies repeat their context, built from
GSM8K: a question, the same question with one number changed, then that one
again (a regenerated answer), so the later replies re-emit much of the
earlier ones (what copy-aware drafting is for). Samples are shuffled with a fixed seed (42) so every run and every
machine benchmarks the same prompts.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from importlib import resources

DATASETS = ("gsm8k", "humaneval", "mt-bench", "edit")
SEED = 42
GSM8K_FORMAT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL_FORMAT = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)


def _lines(name: str) -> list[dict]:
    file = resources.files(__name__).joinpath(name)
    raw = file.read_bytes()
    if name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def conversations(dataset: str) -> list[list[str]]:
    """Every item of `dataset` as its list of user turns (one turn except MT-Bench)."""
    if dataset == "gsm8k":
        return [[GSM8K_FORMAT.format(question=row["question"])] for row in _lines("gsm8k_test.jsonl")]
    if dataset == "humaneval":
        return [[HUMANEVAL_FORMAT.format(prompt=row["prompt"].strip())] for row in _lines("HumanEval.jsonl.gz")]
    if dataset == "mt-bench":
        return [list(row["turns"]) for row in _lines("mt_bench_questions.jsonl")]
    if dataset == "edit":
        questions = [GSM8K_FORMAT.format(question=row["question"]) for row in _lines("gsm8k_test.jsonl")]
        return [[q, changed, changed] for q in questions if (changed := with_a_number_changed(q)) != q]
    raise ValueError(f"--dataset: expected one of {', '.join(DATASETS)}, got {dataset!r}.")


def with_a_number_changed(text: str) -> str:
    """`text` with its first number one larger (unchanged when it has none)."""
    return re.sub(r"\d+", lambda m: str(int(m.group()) + 1), text, count=1)


def sample(dataset: str, num_prompts: int, seed: int = SEED) -> list[list[str]]:
    """`num_prompts` items of `dataset` after a fixed-seed shuffle."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts: expected an integer >= 1, got {num_prompts}.")
    items = conversations(dataset)
    random.Random(seed).shuffle(items)
    return items[:num_prompts]


def long_gsm8k_conversations(tokenizer, min_tokens: int, count: int, start: int = 0, stop: int | None = None):
    """`count` chats of at least `min_tokens` tokens (chat-templated by `tokenizer`): GSM8K test questions
    (rows `start` to `stop`, in file order) with their reference answers as earlier turns, ending with a
    question. For long-context benchmarks and fine-tuning examples (scripts/)."""
    rows = _lines("gsm8k_test.jsonl")[start:stop]
    out, i = [], 0
    while len(out) < count:
        messages: list[dict] = []
        while True:
            row = rows[i % len(rows)]
            i += 1
            question = {"role": "user", "content": GSM8K_FORMAT.format(question=row["question"])}
            text = tokenizer.apply_chat_template(messages + [question], add_generation_prompt=True, tokenize=False)
            if len(tokenizer.encode(text)) >= min_tokens:
                out.append(messages + [question])
                break
            body, _, final = row["answer"].rpartition("####")  # the answer in the demo target's own style
            answer = f"{re.sub(r'<<[^>]*>>', '', body).strip()}\nThe final answer is \\boxed{{{final.strip()}}}."
            messages += [question, {"role": "assistant", "content": answer}]
    return out
