"""`DFlashServer`: a ThreadingHTTPServer in front of one generation worker, and `make_server`.

Each connection gets a handler thread (`handler.Handler`); all of them queue
their requests on the one `worker.GenerationWorker`, which owns the model.
`start()` serves from a background thread (tests, embedding); `serve_forever()`
serves from the caller's. `stop()` shuts the listener down, cancels the
running job, fails queued ones with 503, joins the worker and closes the
socket; it is safe to call more than once. `health()` is ``/health``'s reply.
With an `api_key` every route but ``/health`` wants it; without one, a server
listening beyond the loopback interface warns that anyone who reaches it may
use it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from http.server import ThreadingHTTPServer

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..models.block_size import check_block_size
from ..models.chat_template import reasoning_switches
from ..models.dtype import dtype_name, target_float_dtype
from ..targets.adapter import embedding_shape, token_embedding
from ..targets.families import context_length
from .handler import Handler
from .limits import body_limit, longest_token_bytes
from .openai_responses import DEFAULT_STORED, Conversations
from .prompt_cache import DEFAULT_SESSIONS
from .request import ServerInfo
from .worker import GenerationWorker


class DFlashServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = socket.SOMAXCONN  # socketserver's 5 resets clients that connect at once

    def __init__(
        self,
        address: tuple[str, int],
        worker: GenerationWorker,
        info: ServerInfo,
        *,
        model_id: str,
        draft_id: str | None,
        log_requests: bool = False,
        api_key: str | None = None,
        response_store_size: int = DEFAULT_STORED,
    ):
        infos = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        self.address_family = infos[0][0]
        super().__init__(infos[0][4][:2], Handler)
        self.worker, self.info = worker, info
        self.model_id, self.draft_id = model_id, draft_id
        self.log_requests = log_requests
        self.api_key = api_key or None
        # the Responses API's previous_response_id, within the worker's byte budget
        self.conversations = Conversations(response_store_size, budget=worker.budget)
        worker.budget.register("responses", self.conversations)
        if self.api_key is None and not ipaddress.ip_address(self.server_address[0].split("%")[0]).is_loopback:
            logging.warning(
                "Listening on %s without an API key: anyone who can reach this address can use the "
                "model (set --api-key).",
                self.server_address[0],
            )
        self.created = int(time.time())
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def model_card(self) -> dict:
        """`/v1/models`' entry (OpenAI's fields and Anthropic's), with what this server computes: drafter,
        default block (and whether it is adaptive, up to block_size), dtype."""
        has_draft = self.worker.draft is not None
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "dflash-mlx",
            "type": "model",
            "display_name": self.model_id,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "draft": self.draft_id,
            "block_size": self.worker.block_size if has_draft else None,
            "adaptive_block": self.worker.adaptive,
            "dtype": dtype_name(target_float_dtype(self.worker.model)),
        }

    def health(self) -> tuple[int, dict]:
        """`/health`: the worker alive (200) or not (503), the byte budget's use by part, the requests
        running, queued and cancelled, and the largest body read."""
        worker = self.worker
        body = {
            "status": "ok" if worker.alive else "unavailable",
            "memory": worker.budget.usage(),
            "requests": worker.job_counts(),
            "max_body_bytes": self.info.max_body,
        }
        return (200 if worker.alive else 503), body

    def start(self) -> "DFlashServer":
        """Serve from a background thread; returns at once."""
        self._thread = threading.Thread(target=self.serve_forever, name="dflash-http", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self.shutdown()
            self._thread.join(timeout)
        self.worker.stop(timeout)
        self.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def vocab_size(model, tokenizer) -> int:
    """Rows of the target's embedding table (the logits' width), else the tokenizer's size."""
    embedding = token_embedding(model)
    return embedding_shape(embedding)[0] if embedding is not None else len(tokenizer.vocab)


def make_server(
    model,
    tokenizer,
    draft=None,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_id: str = "default",
    draft_id: str | None = None,
    max_tokens: int = 512,
    block_size: int | None = None,
    chat_template_args: dict | None = None,
    log_requests: bool = False,
    adaptive: bool | None = None,
    prompt_cache_size: int = DEFAULT_SESSIONS,
    prompt_cache_bytes: int | None = None,
    prompt_cache_dir=None,
    group=None,
    decode_concurrency: int = 32,
    prefill_step_size: int = 2048,
    max_batch_bytes: int | None = None,
    kv: dict | None = None,
    api_key: str | None = None,
    response_store_size: int = DEFAULT_STORED,
    registry_entry=None,
    lookup: bool = True,
) -> DFlashServer:
    """A server for a loaded pair (`draft=None`: plain decoding), bound but not yet serving.

    `port=0` picks a free port (see `server.url`). `max_tokens` is the default
    for requests that give none; `block_size` the default block (requests'
    ``num_draft_tokens`` override it): adaptive up to it when `adaptive` (by
    default when no block_size is given), else fixed; `chat_template_args` are passed to the
    chat template of every chat request (``chat_template_kwargs`` add to them).
    The prompt cache keeps up to `prompt_cache_size` conversations (and at most
    `prompt_cache_bytes` of them, None: no bound), on disk too in
    `prompt_cache_dir` (None: in memory only), see `prompt_cache`. With a
    tensor-sharded target, rank 0 makes the server with `group` and the other
    ranks run `make_worker(...).follow()` with the same arguments.
    Up to `decode_concurrency` requests decode together (`batching`; mlx_lm.server's
    default, 32; 1, a sharded target or a family the batch cannot run: one at a time), a
    longer prompt joining them prefilled `prefill_step_size` tokens per step. `max_batch_bytes`
    (default: 3/4 of the device's memory) is the one byte budget of everything the server keeps
    (`budget`: weights, active rows, prompt cache, stored responses, grammars; the least recently
    used go first) in every worker mode: a request joins once its caches fit, and one whose caches
    could not fit even alone is refused (`prompts`). `kv` (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``, as
    `stream_generate` takes them) quantizes every request's KV cache as mlx-lm does (requests
    are then served one at a time). `api_key` (None: none) is required by every route but
    /health; `response_store_size` bounds the Responses API's stored conversations;
    `registry_entry` (the model's models.toml entry) tells how its chat template switches
    reasoning, which requests' thinking / reasoning fields set
    (`models.chat_template.reasoning_switches`). `lookup`: copy-aware drafting for requests that do
    not set ``lookup``.
    """
    check_block_size(block_size, draft)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}.")
    if not isinstance(tokenizer, TokenizerWrapper):  # its think / tool-call markers split the replies
        tokenizer = TokenizerWrapper(tokenizer)
    worker = make_worker(
        model,
        tokenizer,
        draft,
        block_size=block_size,
        adaptive=adaptive,
        prompt_cache_size=prompt_cache_size,
        prompt_cache_bytes=prompt_cache_bytes,
        prompt_cache_dir=prompt_cache_dir,
        group=group,
        decode_concurrency=decode_concurrency,
        prefill_step_size=prefill_step_size,
        max_batch_bytes=max_batch_bytes,
        kv=kv,
    )
    vocab = vocab_size(model, tokenizer)
    room = worker.budget.total - worker.weights
    info = ServerInfo(
        vocab_size=vocab,
        has_draft=draft is not None,
        has_chat_template=bool(tokenizer.has_chat_template),
        model_id=model_id,
        max_tokens=max_tokens,
        chat_template_args=dict(chat_template_args or {}),
        max_block=worker.block_size,
        context_length=worker.context_length,
        reasoning=reasoning_switches(tokenizer, registry_entry, model_id),
        grammars=worker.grammars,
        lookup=lookup,
        max_body=body_limit(worker.context_length, longest_token_bytes(tokenizer), vocab, room),
    )
    server = DFlashServer(
        (host, port),
        worker,
        info,
        model_id=model_id,
        draft_id=draft_id,
        log_requests=log_requests,
        api_key=api_key,
        response_store_size=response_store_size,
    )
    worker.start()
    return server


def make_worker(
    model,
    tokenizer,
    draft=None,
    *,
    block_size: int | None = None,
    adaptive: bool | None = None,
    prompt_cache_size: int = DEFAULT_SESSIONS,
    prompt_cache_bytes: int | None = None,
    prompt_cache_dir=None,
    group=None,
    decode_concurrency: int = 1,
    prefill_step_size: int = 2048,
    max_batch_bytes: int | None = None,
    kv: dict | None = None,
) -> GenerationWorker:
    """The generation worker `make_server` puts behind its listener (not started)."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    return GenerationWorker(
        model,
        tokenizer,
        draft,
        block_size=block_size,
        context_length=context_length(model),
        adaptive=block_size is None if adaptive is None else adaptive,
        prompt_cache_size=prompt_cache_size,
        prompt_cache_bytes=prompt_cache_bytes,
        prompt_cache_dir=prompt_cache_dir,
        group=group,
        decode_concurrency=decode_concurrency,
        prefill_step_size=prefill_step_size,
        max_batch_bytes=max_batch_bytes,
        kv=kv,
    )
