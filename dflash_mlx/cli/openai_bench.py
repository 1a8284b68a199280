"""`dflash-mlx bench --backend openai`: the benchmark against OpenAI-compatible servers.

The same fixed-seed prompt sample as the local backend is sent through the
official `openai` client, streamed (time to first token, per-request decode
speed), with `concurrency` requests in flight (threads) after a warm-up; a
later turn (MT-Bench's second) is fed the server's own first reply. Each leg
is one server: ``dflash`` (`--base-url`) and optionally ``baseline``
(`--baseline-url`), run one after the other. Acceptance comes from the
server's own statistics: this project's ``dflash`` object, SGLang's
``meta_info.spec_accept_length`` (asked with ``return_meta_info``), or vLLM's
spec-decode counters on ``/metrics`` read before and after the leg; None (and
said so) when a server reports none. `run_leg` raises `RemoteError` with the
URL and the status for an unreachable server, an HTTP error, a model it does
not serve or a timeout; nothing is reported for a leg that did not finish.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

WARMUP_TOKENS = 8


class RemoteError(RuntimeError):
    """A server that cannot be benchmarked: the message names the URL and what went wrong."""


def api_url(url: str) -> str:
    """The API root (…/v1) of a server URL given with or without /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


@dataclass
class RemoteSettings:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    concurrency: int = 1
    timeout_s: float = 600.0
    api_key: str = "unused"
    template_kwargs: dict = field(default_factory=dict)


@dataclass
class Request:
    ttft_s: float
    latency_s: float
    completion_tokens: int
    acceptance: float | None  # tokens per verify, as the server reports it
    acceptance_source: str | None  # where it reported it ("dflash", "meta_info")


@dataclass
class LegResult:
    name: str
    url: str
    model: str
    card: dict
    wall_s: float = 0.0
    requests: list[Request] = field(default_factory=list)
    vllm_acceptance: float | None = None  # from /metrics around the leg (servers that report none per reply)

    @property
    def acceptance_source(self) -> str | None:
        sources = {r.acceptance_source for r in self.requests if r.acceptance_source}
        if self.vllm_acceptance is not None:
            sources.add("vllm /metrics")
        return ", ".join(sorted(sources)) or None


def _client(url: str, settings: RemoteSettings):
    import openai

    return openai.OpenAI(base_url=api_url(url), api_key=settings.api_key, max_retries=0, timeout=settings.timeout_s)


def _explain(url: str, error: Exception) -> RemoteError:
    import openai

    if isinstance(error, openai.APITimeoutError):
        return RemoteError(f"{url}: no answer within the timeout (--timeout-s)")
    if isinstance(error, openai.APIConnectionError):
        return RemoteError(f"{url}: cannot connect ({error.__cause__ or error})")
    if isinstance(error, openai.APIStatusError):
        body = error.body if isinstance(error.body, dict) else {}  # the client may have unwrapped "error"
        body = body["error"] if isinstance(body.get("error"), dict) else body
        message = body.get("message") if isinstance(body.get("message"), str) else error.message
        return RemoteError(f"{url} answered HTTP {error.status_code}: {message}")
    return RemoteError(f"{url}: {type(error).__name__}: {error}")


def describe_server(
    url: str, model: str | None, settings: RemoteSettings, warn: Callable[[str], None] = lambda message: None
) -> tuple[str, dict]:
    """(the model id to use, its /v1/models entry); the first served id when `model` is None.

    A /v1/models that answers 200 with something that is not a model list (mlx_lm.server 0.32
    sends an empty body when the Hugging Face cache directory does not exist) is reported with
    `warn`, and the requests then name `model` or mlx-lm's "default_model"."""
    import openai

    try:
        with _client(url, settings) as client:
            cards = [m.model_dump() for m in client.models.list().data]
    except (openai.APIStatusError, openai.APIConnectionError) as e:
        raise _explain(url, e) from None
    except (ValueError, TypeError, AttributeError, openai.OpenAIError) as e:
        warn(
            f"{api_url(url)}/models did not answer with a model list ({type(e).__name__}); "
            f"using the model id {model or 'default_model'!r}"
        )
        return model or "default_model", {"id": None, "models_error": f"{type(e).__name__}: {e}"}
    ids = [c.get("id") for c in cards]
    if not ids:
        raise RemoteError(f"{url}: /v1/models lists no model")
    if model is None:
        return ids[0], cards[0]
    if model not in ids:
        raise RemoteError(f"{url} does not serve the model {model!r}; it serves {', '.join(map(str, ids))}")
    return model, cards[ids.index(model)]


def _vllm_counters(url: str) -> tuple[float, float] | None:
    """vLLM's accepted-token and draft counters from /metrics (None when the server has none)."""
    base = api_url(url).removesuffix("/v1")
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
            text = reply.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None

    def total(name: str) -> float | None:
        values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)$", text, re.M)]
        return sum(values) if values else None

    accepted, drafts = total("vllm:spec_decode_num_accepted_tokens_total"), total("vllm:spec_decode_num_drafts_total")
    return None if accepted is None or drafts is None else (accepted, drafts)


def _one_request(client, model: str, messages: list[dict], settings: RemoteSettings, max_tokens: int):
    """Stream one chat completion; returns (its text, its Request)."""
    extra = {"return_meta_info": True}
    if settings.top_k:
        extra["top_k"] = settings.top_k
    if settings.template_kwargs:
        extra["chat_template_kwargs"] = settings.template_kwargs
    tic = time.perf_counter()
    first, text, usage, acceptance = None, "", None, None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in stream:
        extra_fields = chunk.model_extra or {}
        stats = extra_fields.get("dflash") or {}
        meta = extra_fields.get("meta_info") or {}
        if stats.get("mean_acceptance_length") is not None:
            acceptance = ("dflash", float(stats["mean_acceptance_length"]))
        elif meta.get("spec_accept_length") is not None:
            acceptance = ("meta_info", float(meta["spec_accept_length"]))
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            delta = chunk.choices[0].delta
            piece = (delta.content or "") + (getattr(delta, "reasoning", None) or "")
            if piece and first is None:
                first = time.perf_counter()
            text += delta.content or ""
    done = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else 0
    source, value = acceptance or (None, None)
    return text, Request(
        ttft_s=(first or done) - tic,
        latency_s=done - tic,
        completion_tokens=tokens,
        acceptance=value,
        acceptance_source=source,
    )


def run_leg(
    name: str,
    url: str,
    model: str,
    card: dict,
    conversations: list[list[str]],
    settings: RemoteSettings,
    on_request: Callable[[int], None] | None = None,
) -> LegResult:
    """Warm up, then every conversation with `settings.concurrency` in flight."""
    import openai

    leg = LegResult(name, url, model, card)
    done, lock = 0, threading.Lock()

    def converse(i: int, client) -> list[Request]:
        nonlocal done
        messages, out = [], []
        for turn in conversations[i]:
            messages.append({"role": "user", "content": turn})
            text, request = _one_request(client, model, messages, settings, settings.max_tokens)
            messages.append({"role": "assistant", "content": text})
            out.append(request)
        with lock:
            done += 1
            if on_request:
                on_request(done)
        return out

    try:
        with _client(url, settings) as client:
            warm = [[c[0]] for c in conversations[: max(1, settings.concurrency)]]
            with ThreadPoolExecutor(settings.concurrency) as pool:
                list(
                    pool.map(
                        lambda c: _one_request(
                            client, model, [{"role": "user", "content": c[0]}], settings, WARMUP_TOKENS
                        ),
                        warm,
                    )
                )
            before = _vllm_counters(url)
            tic = time.perf_counter()
            with ThreadPoolExecutor(settings.concurrency) as pool:
                for requests in pool.map(lambda i: converse(i, client), range(len(conversations))):
                    leg.requests.extend(requests)
            leg.wall_s = time.perf_counter() - tic
            after = _vllm_counters(url)
    except openai.OpenAIError as e:
        raise _explain(url, e) from None
    if before is not None and after is not None and after[1] > before[1]:
        leg.vllm_acceptance = 1.0 + (after[0] - before[0]) / (after[1] - before[1])
    return leg


def _spread(values: list[float], with_p90: bool = True) -> dict:
    if not values:
        return {"mean": None, "p50": None, **({"p90": None} if with_p90 else {})}
    ordered = sorted(values)
    out = {"mean": round(statistics.fmean(values), 4), "p50": round(statistics.median(values), 4)}
    if with_p90:
        out["p90"] = round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4)
    return out


def leg_record(leg: LegResult, concurrency: int) -> dict:
    tokens = sum(r.completion_tokens for r in leg.requests)
    decode = [
        (r.completion_tokens - 1) / (r.latency_s - r.ttft_s)
        for r in leg.requests
        if r.completion_tokens > 1 and r.latency_s > r.ttft_s
    ]
    reported = [r.acceptance for r in leg.requests if r.acceptance is not None]
    acceptance = statistics.fmean(reported) if reported else leg.vllm_acceptance
    return {
        "url": leg.url,
        "model": leg.model,
        "concurrency": concurrency,
        "requests": len(leg.requests),
        "output_tokens": tokens,
        "wall_s": round(leg.wall_s, 4),
        "throughput_tps": round(tokens / leg.wall_s, 3) if leg.wall_s > 0 else 0.0,
        "latency_s": _spread([r.latency_s for r in leg.requests]),
        "ttft_s": _spread([r.ttft_s for r in leg.requests]),
        "decode_tps": _spread(decode, with_p90=False),
        "acceptance_length": round(acceptance, 4) if acceptance is not None else None,
        "acceptance_source": leg.acceptance_source,
    }
