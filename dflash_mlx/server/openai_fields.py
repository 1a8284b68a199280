"""OpenAI's standard request fields beyond sampling: no-ops checked and ignored, refusals, translations.

Every field of OpenAI's Chat Completions and Completions request schemas (the
``openai`` package's ``types/chat/completion_create_params.py`` and
``types/completion_create_params.py``) is served, ignored or refused:

- `IGNORED`: no-ops for a local server, type-checked and bounded, then
  ignored (`ignored`): ``store``, ``metadata`` (at most 16 string values),
  ``service_tier``, ``user``, ``safety_identifier``, ``prompt_cache_key``,
  ``prompt_cache_options``, ``prompt_cache_retention`` (the prompt cache is
  automatic), ``modalities: ["text"]``, ``parallel_tool_calls`` (the model
  and its template decide), ``verbosity`` and ``prediction`` (a hint that
  would only change the speed: the output does not depend on it);
- honoured elsewhere: ``reasoning_effort`` (`reasoning`: the template's
  reasoning switch, as ``--reasoning``), ``response_format``
  (`formats`), the legacy ``functions`` / ``function_call`` (`legacy_functions`:
  translated into tools, and the reply's call back into ``function_call``);
- `REFUSED` (a 400 naming the field): what would change the output and cannot
  be honoured here: audio output (``audio``, ``modalities`` with "audio"),
  ``web_search_options``, ``moderation``; and ``n`` other than 1
  (`request`).
"""

from __future__ import annotations

from .errors import RequestError
from .conversation import function_tool, tool_choice
from .fields import EFFORTS, Fields, listed, reasoning_args

MAX_STRING = 4096  # characters of an ignored string field
IGNORED = (
    "store",
    "metadata",
    "service_tier",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "modalities",
    "parallel_tool_calls",
    "verbosity",
    "prediction",
)
REFUSED = {
    "audio": "audio output is not available on this server (text only)",
    "web_search_options": "web search is not available on this server",
    "moderation": "moderation is not available on this server",
}
CHAT_ONLY = (
    set(IGNORED) - {"user"} | set(REFUSED) | {"reasoning_effort", "response_format", "functions", "function_call"}
)


def ignored(b: Fields) -> None:
    """Check the ignored fields present in body `b` (types and bounds); they change nothing."""
    for name in ("service_tier", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"):
        value = b.string(name)
        if value is not None and len(value) > MAX_STRING:
            raise RequestError(name, f"at most {MAX_STRING} characters, got {len(value)}")
    b.boolean("store")
    b.boolean("parallel_tool_calls", True)
    b.string("verbosity", None, ("low", "medium", "high"))
    metadata(b)
    options = Fields(b.mapping("prompt_cache_options"), "prompt_cache_options.")
    options.unknown({"mode", "ttl"})
    options.string("mode", None, ("implicit", "explicit"))
    options.string("ttl")
    modalities = b.get("modalities", ["text"])
    if not isinstance(modalities, list) or not all(m in ("text", "audio") for m in modalities) or len(modalities) > 2:
        raise RequestError("modalities", f"expected a list of 'text' and 'audio', got {modalities!r}")
    if "audio" in modalities:
        raise RequestError("modalities", "audio output is not available on this server (text only)")
    prediction = Fields(b.mapping("prediction"), "prediction.")
    if prediction.body:
        prediction.unknown({"type", "content"})
        prediction.string("type", "content", ("content",))
        content = prediction.get("content", "")
        if not isinstance(content, str) and not (
            isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content)
        ):
            raise RequestError("prediction.content", "expected a string or a list of text parts")
    for name, reason in REFUSED.items():
        if b.get(name) is not None:
            raise RequestError(name, reason)


def metadata(b: Fields) -> dict:
    """``metadata``: at most 16 string values, keys of at most 64 characters, values of 512 (OpenAI's bounds)."""
    value = b.mapping("metadata")
    if len(value) > 16 or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()
    ):
        raise RequestError("metadata", "expected at most 16 string values (keys of 64 characters, values of 512)")
    return value


def legacy_functions(body: dict) -> tuple[list | None, object] | None:
    """The legacy ``functions`` / ``function_call`` as (tools, tool_choice) in today's shape, checked by
    the shared parser (`conversation`) under their own names (None when neither is given); a request
    giving both old and new fields is refused."""
    functions, call = body.get("functions"), body.get("function_call")
    if functions is None and call is None:
        return None
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        raise RequestError(
            "functions" if functions is not None else "function_call",
            "give tools / tool_choice or the legacy functions / function_call, not both",
        )
    for i, function in enumerate(listed(functions, "functions", "functions")):
        f = Fields(function if isinstance(function, dict) else {}, f"functions[{i}].")
        f.unknown({"name", "description", "parameters"})
        function_tool(f.body, f"functions[{i}].")
    tools = [{"type": "function", "function": f} for f in functions or []] or None
    if call is None or call in ("auto", "none"):
        return tools, call
    if isinstance(call, dict) and set(call) == {"name"} and isinstance(call["name"], str):
        return tools, tool_choice("function", tools, "function_call", call["name"], "function_call.name")
    raise RequestError("function_call", f"expected 'auto', 'none' or {{'name': ...}}, got {call!r}")


def legacy_messages(messages) -> list:
    """A history's assistant ``function_call`` (the legacy shape) as today's ``tool_calls`` (one call,
    id ``call_legacy_<index>``), so the checks and templates see one shape; the legacy ``role:
    "function"`` results, which name no call, are `messages`' (they answer the oldest open call)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("function_call") is not None:
            m = {k: v for k, v in m.items() if k != "function_call"}
            m["tool_calls"] = [{"id": f"call_legacy_{i}", "type": "function", "function": messages[i]["function_call"]}]
        out.append(m)
    return out


def reasoning(b: Fields, info) -> dict:
    """The chat template arguments of ``reasoning_effort`` ({} when absent)."""
    effort = b.string("reasoning_effort", None, tuple(EFFORTS))
    return {} if effort is None else reasoning_args(info, EFFORTS[effort], "reasoning_effort")
