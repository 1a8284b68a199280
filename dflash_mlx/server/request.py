"""The server's request model (`GenerationRequest`) and chat / text completions' bodies parsed into it.

Every dialect (`dialect`) parses into the same `GenerationRequest`: chat
messages and tools as chat templates take them, sampling, stops and limits,
the grammar of a structured output (`formats`); the checks they share are
here and in `fields` (`check_model`, `sampling`, `stops`; `Fields`,
`reasoning_args`). OpenAI's standard fields beyond these (no-ops, refusals,
``reasoning_effort``, the legacy ``functions``) are `openai_fields`'.

Every field of OpenAI's request schemas and every field mlx-lm's server reads
is honoured, ignored (a no-op here, still checked) or refused with a
`RequestError` naming it (HTTP 400); so is every field this module does not
know. Sampling values follow mlx-lm's meaning (`dflash_mlx.sampling`), and the
penalties are mlx-lm's logits processors (``make_logits_processors``: presence
and frequency penalties count the last ``*_context_size`` tokens, prompt
included); a temperature below `MIN_TEMPERATURE` is greedy decoding. Sizes
are bounded by the model and the server (`ServerInfo`): ``num_draft_tokens``
by the widest block it verifies, penalty windows by the context, at most
`MAX_STOPS` stop sequences of `MAX_STOP_CHARS` characters. Refused:
``n``/``best_of`` other than 1, ``echo``, ``suffix``, ``adapters``, another
``draft_model``, and XTC when the server has a drafter (XTC has no fixed
distribution to verify drafts against). ``model`` must be the served model's
id (GET /v1/models) or mlx-lm's "default_model".

Tools (`tools`, `tool_choice`, assistant messages with ``tool_calls``,
``role: "tool"`` messages) are chat completions' spelling (`messages`) of
what every dialect parses alike (`conversation`): function definitions with a
name and an object of parameters, ``tool_choice`` "auto", "none", "required"
or a function of `tools`, and the one rule for tool results (a result answers
an earlier call not answered yet). Like mlx_lm.server, the server leaves the
choice to the model and its template (the tools are rendered whatever
`tool_choice` says). Call arguments given as JSON strings are parsed for the
template, as mlx_lm.server
does. ``return_meta_info`` asks for SGLang's ``meta_info`` object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .messages import messages as chat_messages, tool_choice, tools
from .errors import RequestError
from .fields import Fields, is_int, is_number
from .formats import response_format
from .openai_fields import CHAT_ONLY, ignored, legacy_functions, legacy_messages, reasoning

COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "xtc_probability",
    "xtc_threshold",
    "num_draft_tokens",
    "draft_model",
    "adapters",
    "n",
    "user",
    "return_meta_info",
    "lookup",
}
CHAT = COMMON | {"messages", "tools", "tool_choice", "role_mapping", "chat_template_kwargs"} | CHAT_ONLY
TEXT = COMMON | {"prompt", "echo", "suffix", "best_of"}
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 32  # stop sequences per request, each at most MAX_STOP_CHARS characters (matched on every token)
MAX_STOP_CHARS = 256
MIN_TEMPERATURE = 1e-5  # a temperature below it is served as greedy decoding (its limit)
MAX_INDEX = 2**31 - 1  # MLX slices with 32-bit indices: the bound of a context size when the model gives none


@dataclass(frozen=True)
class ServerInfo:
    """What validation needs to know about the served pair, and the server's defaults."""

    vocab_size: int
    has_draft: bool
    has_chat_template: bool
    model_id: str = "default"
    max_tokens: int = 512
    chat_template_args: dict = field(default_factory=dict)
    max_block: int = 1  # the widest block this server verifies (anchor included): num_draft_tokens < it
    context_length: int | None = None  # the model's context in tokens (None: its config gives none)
    reasoning: dict = field(default_factory=dict)  # level -> template arguments, or why not (reasoning_switches)
    grammars: object = None  # the worker's `formats.Grammars` (structured outputs), None: unavailable
    lookup: bool = True  # copy-aware drafting for requests that do not say (`serve --lookup`)
    max_body: int | None = None  # the largest request body read, bytes (`limits.body_limit`; None: any)

    @property
    def window_bound(self) -> int:
        """The largest token window a request may name (penalty context sizes)."""
        return min(self.context_length or MAX_INDEX, MAX_INDEX)


@dataclass
class GenerationRequest:
    kind: str  # "chat" or "text"
    messages: list | None = None
    prompt: str | list[int] | None = None
    role_mapping: dict | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    stop: list[str] = field(default_factory=list)
    processors: dict = field(default_factory=dict)  # keyword arguments of make_logits_processors
    logprobs: bool = False
    top_logprobs: int = 0
    num_draft_tokens: int | None = None
    lookup: bool = True  # copy-aware drafting (`policy.adaptive`; in a batch, `batch.engine`)
    key: int | None = None  # the number of the API key it came with (never the key): its suffix scope
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    return_meta_info: bool = False
    grammar: str | None = None  # llguidance grammar text the output follows (`formats`)
    grammar_field: str | None = None  # the dialect's field that gave the grammar (its errors name it)
    legacy_functions: bool = False  # the request used ``functions``: the reply's call is a ``function_call``


def parse_request(kind: str, body, info: ServerInfo) -> GenerationRequest:
    """Validate a /v1/chat/completions ("chat") or /v1/completions ("text") body."""
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    b = Fields(body)
    b.unknown(CHAT if kind == "chat" else TEXT)
    req = GenerationRequest(kind=kind)
    _refusals(b, kind, info)
    ignored(b)
    if kind == "chat":
        legacy = legacy_functions(body)
        req.legacy_functions = legacy is not None
        if legacy is not None:
            req.tools, req.tool_choice = legacy
        else:
            req.tools = tools(body.get("tools"))
            req.tool_choice = tool_choice(body.get("tool_choice"), req.tools)
        req.messages = chat_messages(legacy_messages(body.get("messages")))
        req.role_mapping = _role_mapping(b, info)
        chat_kwargs = b.mapping("chat_template_kwargs")
        req.chat_template_kwargs = {**info.chat_template_args, **reasoning(b, info), **chat_kwargs}
    else:
        req.prompt = _prompt(body.get("prompt"), info.vocab_size)
    req.model = check_model(body.get("model"), info)
    _lengths(b, req, info)
    sampling(b, req, info)
    req.processors = _processors(b, info)
    req.stop = stops(body.get("stop"))
    _logprobs(b, req, kind)
    req.stream = b.boolean("stream")
    req.return_meta_info = b.boolean("return_meta_info")
    options = Fields(b.mapping("stream_options"), "stream_options.")
    if options.body and not req.stream:
        raise RequestError("stream_options", "only allowed with stream: true")
    options.unknown({"include_usage", "include_obfuscation"})
    options.boolean("include_obfuscation", True)  # (no padding to hide lengths: this server is local)
    req.include_usage = options.boolean("include_usage")
    if kind == "chat":  # (last: compiling a grammar is the costliest check)
        req.grammar = response_format(body.get("response_format"), info.grammars, "response_format")
        req.grammar_field = "response_format"
    return req


def check_model(model, info: ServerInfo):
    """The request's ``model``: the served model's id, mlx-lm's "default_model" or none."""
    if model not in (None, "default_model", info.model_id):
        raise RequestError("model", f"this server serves {info.model_id!r} only (see GET /v1/models), got {model!r}")
    return model


def _refusals(b: Fields, kind: str, info: ServerInfo) -> None:
    if b.get("n", 1) != 1:
        raise RequestError("n", f"only one choice per request is supported, got {b.get('n')!r}")
    if b.get("draft_model") not in (None, "default_model"):
        raise RequestError("draft_model", "this server runs the one drafter chosen when it started (--draft)")
    if b.get("adapters") is not None:
        raise RequestError("adapters", "LoRA adapters are not supported by this server")
    if kind != "chat":
        if b.get("best_of", 1) != 1:
            raise RequestError("best_of", f"only 1 is supported, got {b.get('best_of')!r}")
        if b.get("echo", False) is not False:
            raise RequestError("echo", "echoing the prompt is not supported")
        if b.get("suffix") is not None:
            raise RequestError("suffix", "insertion (a suffix) is not supported")


def _role_mapping(b: Fields, info: ServerInfo) -> dict | None:
    mapping = b.get("role_mapping")
    if mapping is None:
        return None
    if info.has_chat_template:
        raise RequestError("role_mapping", "the model has a chat template; role_mapping is only used without one")
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise RequestError("role_mapping", "expected an object of strings")
    return mapping


def _prompt(prompt, vocab_size: int) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return list(prompt)
    raise RequestError("prompt", "expected a non-empty string or a non-empty list of token ids (one prompt)")


def _lengths(b: Fields, req: GenerationRequest, info: ServerInfo) -> None:
    a = b.integer("max_completion_tokens", None, low=1)
    m = b.integer("max_tokens", None, low=1)
    if a is not None and m is not None and a != m:
        raise RequestError("max_completion_tokens", f"differs from max_tokens ({a} != {m}); give one of them")
    req.max_tokens = a or m or info.max_tokens


def sampling(b: Fields, req: GenerationRequest, info: ServerInfo) -> None:
    """temperature, top_p, top_k, min_p, seed, XTC, num_draft_tokens and lookup (absent: the defaults)."""
    req.temperature = b.number("temperature", 0.0, low=0)
    if req.temperature < MIN_TEMPERATURE:  # dividing float32 logits by less overflows them (vLLM's rule too)
        req.temperature = 0.0
    req.top_p = b.number("top_p", 1.0, low=0, high=1, low_open=True)
    req.top_k = b.integer("top_k", 0, low=0)
    if req.top_k >= info.vocab_size:
        raise RequestError("top_k", f"must be smaller than the vocabulary ({info.vocab_size}), got {req.top_k}")
    req.min_p = b.number("min_p", 0.0, low=0, high=1)
    req.seed = b.integer("seed", None, low=0, high=2**63 - 1)
    req.xtc_probability = b.number("xtc_probability", 0.0, low=0, high=1)
    req.xtc_threshold = b.number("xtc_threshold", 0.1, low=0, high=0.5)
    if req.xtc_probability > 0 and info.has_draft:
        raise RequestError(
            "xtc_probability",
            "XTC has no fixed distribution, so drafted tokens cannot be verified "
            "against it: this server (with a drafter) cannot run it",
        )
    req.num_draft_tokens = b.integer("num_draft_tokens", None)
    if req.num_draft_tokens is not None and not info.has_draft:
        raise RequestError("num_draft_tokens", "this server has no drafter")
    if req.num_draft_tokens is not None and not 0 <= req.num_draft_tokens < info.max_block:
        raise RequestError(
            "num_draft_tokens",
            f"must be in [0, {info.max_block - 1}]: this server verifies blocks "
            f"of at most {info.max_block} tokens (the anchor and "
            f"{info.max_block - 1} drafts), got {req.num_draft_tokens}",
        )
    req.lookup = b.boolean("lookup", info.lookup)


def _processors(b: Fields, info: ServerInfo) -> dict:
    kwargs, vocab_size, window = {}, info.vocab_size, info.window_bound
    bias = b.mapping("logit_bias")
    if bias:
        parsed = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise RequestError("logit_bias", f"keys must be token ids, got {key!r}") from None
            if not 0 <= token < vocab_size:
                raise RequestError("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")
            if not is_number(value) or not -100 <= value <= 100:
                raise RequestError("logit_bias", f"biases must be numbers in [-100, 100], got {value!r}")
            parsed[token] = float(value)
        kwargs["logit_bias"] = parsed
    penalty = b.number("repetition_penalty", 0.0, low=0)
    if penalty:
        kwargs["repetition_penalty"] = penalty
        kwargs["repetition_context_size"] = b.integer("repetition_context_size", 20, low=1, high=window)
    for name in ("presence", "frequency"):
        value = b.number(f"{name}_penalty", 0.0, low=-2, high=2)
        if value:
            kwargs[f"{name}_penalty"] = value
            kwargs[f"{name}_context_size"] = b.integer(f"{name}_context_size", 20, low=1, high=window)
    for name in ("repetition", "presence", "frequency"):
        if b.get(f"{name}_context_size") is not None and f"{name}_context_size" not in kwargs:
            raise RequestError(f"{name}_context_size", f"has no effect without a non-zero {name}_penalty")
    return kwargs


def stops(stop, name: str = "stop") -> list[str]:
    """The stop sequences of field `name`: a string or a list of at most `MAX_STOPS` non-empty ones."""
    if stop is None:
        return []
    out = [stop] if isinstance(stop, str) else stop
    if not isinstance(out, list) or not all(isinstance(s, str) and s for s in out):
        raise RequestError(name, f"expected a non-empty string or a list of them, got {stop!r}")
    if len(out) > MAX_STOPS:
        raise RequestError(name, f"at most {MAX_STOPS} stop sequences, got {len(out)}")
    long = next((s for s in out if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise RequestError(name, f"a stop sequence is at most {MAX_STOP_CHARS} characters, got {len(long)}")
    return out


def _logprobs(b: Fields, req: GenerationRequest, kind: str) -> None:
    value = b.get("logprobs", False)
    top = b.integer("top_logprobs", None, low=-1, high=MAX_TOP_LOGPROBS)
    if kind == "text" and is_int(value):  # the legacy completions API: logprobs = how many top entries
        if not 0 <= value <= MAX_TOP_LOGPROBS:
            raise RequestError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if top not in (None, -1, value):
            raise RequestError("top_logprobs", "give the number of top entries once (logprobs is an integer)")
        req.logprobs, req.top_logprobs = True, value
        return
    req.logprobs = b.boolean("logprobs")
    req.top_logprobs = 0 if top in (None, -1) else top
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs", "requires logprobs: true")
