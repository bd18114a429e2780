"""OpenAI-compatible HTTP front of the router: `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/models`, on the router's HTTP port (README.md "OpenAI-compatible HTTP").

Every request runs through `GenerationService.Generate`, as a gRPC call does (validation, routing, retries,
metrics, cancellation): the HTTP handler thread submits one Generate coroutine per prompt to the router's
loop (`asyncio.run_coroutine_threadsafe`), with a stand-in for the gRPC context whose `write` puts messages
into a thread-safe queue that the handler drains into the HTTP response. A client that goes away (a failed
write, or its socket closed while the handler waits) cancels those coroutines: the request is aborted on
the nodes exactly as a cancelled gRPC stream is. Stop strings are matched here, on the detokenized text; a
match ends the request through `GenerationService.finish` (its workers are aborted, it counts as ok).

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status of the
gRPC status the service ended with (INVALID_ARGUMENT 400, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, ...).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import grpc

from baton.engine.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, TextTokenizer
from baton.proto.convert import FINISH_FROM_PROTO
from baton.proto.v1 import generation_pb2
from baton.router.security import RouterSecurity

log = logging.getLogger(__name__)

COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
PATHS = (COMPLETIONS, CHAT, MODELS)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MAX_BODY_BYTES = 64 << 20
# How often a handler waiting for tokens checks that its client is still connected.
POLL_S = 0.05

_HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.CANCELLED: (499, "server_error"),
}


class ApiError(Exception):
    """Answered as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def of_grpc(cls, code: grpc.StatusCode, message: str) -> ApiError:
        status, type_ = _HTTP_OF_GRPC.get(code, (500, "server_error"))
        return cls(status, message, type_, code=code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, expected: str, got: Any) -> ApiError:
    return ApiError(400, f"{param}: expected {expected}, got {got!r}", param=param)


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported by this server", param=param, code="unsupported")


# ---- chat templates -----------------------------------------------------------------------------------
def load_chat_template(tokenizer_path: str | None) -> str | None:
    """The model's chat template (Jinja source): `chat_template.jinja` beside the tokenizer, else
    `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: "default" wins)."""
    if not tokenizer_path:
        return None
    p = Path(tokenizer_path)
    d = p.parent if p.name == TOKENIZER_FILE else p
    if (d / CHAT_TEMPLATE_FILE).is_file():
        return (d / CHAT_TEMPLATE_FILE).read_text()
    cfg_path = d / TOKENIZER_CONFIG_FILE
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    t = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        t = named.get("default", next(iter(named.values()), None))
    return t if isinstance(t, str) and t else None


class ChatTemplate:
    """A chat template compiled as transformers does (sandboxed Jinja, `trim_blocks`, `lstrip_blocks`,
    `raise_exception`, a JSON `tojson`). Needs jinja2, imported only when a model has a template."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        self._error = jinja2.exceptions.TemplateError
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat_template: does not compile: {e}") from e
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except self._error as e:
            raise ApiError(400, f"messages: the chat template refused them: {e}", param="messages") from e


def _token_text(tok: TextTokenizer, i: int | None) -> str:
    return (tok.tokenizer.id_to_token(i) or "") if i is not None else ""


# ---- request parsing ----------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        raise _bad(name, f"an integer in [{lo}, {hi}]", v)
    return v


def _opt_float(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise _bad(name, "a number", v)
    return float(v)


def _sampling(body: dict, chat: bool) -> generation_pb2.SamplingParams:
    """OpenAI's parameters (and vLLM-style extensions: top_k, stop_token_ids, ignore_eos) as the proto's.
    Ranges beyond the proto's types are checked by the service's validation (400 with its message)."""
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise _bad(name, "1 (one choice per prompt)", body.get(name))
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _unsupported(name, "a non-zero penalty")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "logit_bias")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise _unsupported("logprobs", "logprobs")
    p = generation_pb2.SamplingParams()
    max_tokens = _opt_int(body, "max_completion_tokens", 0, 2**32 - 1) if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 0, 2**32 - 1)
    if max_tokens is not None:
        p.max_tokens = max_tokens
    # OpenAI's defaults (temperature 1, top_p 1), not the gRPC API's greedy default.
    t = _opt_float(body, "temperature")
    p.temperature = 1.0 if t is None else t
    top_p = _opt_float(body, "top_p")
    if top_p is not None:
        p.top_p = top_p
    if (top_k := _opt_int(body, "top_k", -1, 2**32 - 1)) is not None and top_k > 0:
        p.top_k = top_k
    if (seed := _opt_int(body, "seed", 0, 2**64 - 1)) is not None:
        p.seed = seed
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(i) and 0 <= i < 2**32 for i in stop_ids):
        raise _bad("stop_token_ids", "a list of token ids", stop_ids)
    p.stop_token_ids.extend(stop_ids)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", "a boolean", ignore_eos)
    p.ignore_eos = ignore_eos
    return p


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "a non-empty string or a list of them", stop)
    return tuple(stops)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(i) for i in v)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return list(prompt)
    raise _bad("prompt", "a string, a non-empty list of token ids, or a non-empty list of those", prompt)


def _content(message: dict, i: int) -> str | None:
    c = message.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _unsupported(f"messages[{i}].content", "a content part other than text")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", "a string or a list of text parts", c)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages", messages)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "an object with a string role", m)
        out.append({**m, "content": _content(m, i)})
    return out


@dataclass
class _Job:
    """One parsed HTTP request: its Generate calls (one per prompt) and how to answer."""

    id: str
    chat: bool
    model: str
    requests: list[generation_pb2.GenerateRequest]
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    stops: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))


# ---- bridging to the loop -----------------------------------------------------------------------------
_MSG, _ERROR, _END = "msg", "error", "end"


class _ContextAborted(Exception):
    pass


class _Context:
    """What `GenerationService.Generate` needs of a `grpc.aio.ServicerContext`; feeds the handler's queue."""

    def __init__(self, put: Callable[[tuple], None], index: int) -> None:
        self._put, self._index = put, index

    async def write(self, msg: generation_pb2.GenerateResponse) -> None:
        self._put((self._index, _MSG, msg))

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._put((self._index, _ERROR, ApiError.of_grpc(code, details)))
        raise _ContextAborted(details)

    def time_remaining(self) -> float | None:
        return None


class _ClientGone(Exception):
    pass


class _Run:
    """The Generate calls of one HTTP request, running on the router's loop."""

    def __init__(self, front: OpenAIFront, requests: Sequence[generation_pb2.GenerateRequest]) -> None:
        self.front = front
        self.request_ids = [r.request_id for r in requests]
        self.queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.futures: list[concurrent.futures.Future] = [
            asyncio.run_coroutine_threadsafe(self._one(i, r), front.loop) for i, r in enumerate(requests)]

    async def _one(self, i: int, request: generation_pb2.GenerateRequest) -> None:
        try:
            await self.front.service.Generate(request, _Context(self.queue.put, i))
        except _ContextAborted:
            pass
        except Exception as e:  # a bug: the client still gets an answer
            log.exception("request %s failed", request.request_id)
            self.queue.put((i, _ERROR, ApiError(500, f"internal error: {e!r}", "server_error")))
        finally:
            self.queue.put((i, _END, None))

    def next(self, gone: Callable[[], bool]) -> tuple:
        while True:
            try:
                return self.queue.get(timeout=POLL_S)
            except queue.Empty:
                if self.front.closed:
                    raise ApiError(503, "the router is shutting down", "server_error", code="unavailable") from None
                if gone():
                    raise _ClientGone from None

    def finish(self, i: int) -> None:
        self.front.loop.call_soon_threadsafe(self.front.service.finish, self.request_ids[i])

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()


def _peer_gone(sock: socket.socket) -> bool:
    """True once the client has closed its end (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class _Exchange:
    """Writing one HTTP answer: JSON, or an SSE stream (HTTP/1.0: the stream ends when the socket closes)."""

    def __init__(self, req: BaseHTTPRequestHandler) -> None:
        self.req = req
        self.started = False

    def json(self, status: int, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.started = True
        self.req.send_response(status)
        self.req.send_header("Content-Type", "application/json")
        self.req.send_header("Content-Length", str(len(body)))
        self.req.end_headers()
        self.req.wfile.write(body)

    def event(self, obj: object) -> None:
        if not self.started:
            self.started = True
            self.req.close_connection = True
            self.req.send_response(200)
            self.req.send_header("Content-Type", "text/event-stream")
            self.req.send_header("Cache-Control", "no-cache")
            self.req.end_headers()
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.req.wfile.write(f"data: {data}\n\n".encode())


# ---- stop strings -------------------------------------------------------------------------------------
class _StopMatcher:
    """Holds back the text that could still start a stop string; cuts the text before the first match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def push(self, delta: str, final: bool) -> tuple[str, bool]:
        """(text to emit, whether a stop string matched)."""
        self.pending += delta
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0 if final else min(self.hold, len(self.pending))
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False


@dataclass
class _Choice:
    prompt_tokens: int
    matcher: _StopMatcher
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # chat streams: the role delta was sent

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _usage(choices: Sequence[_Choice]) -> dict:
    p, c = sum(x.prompt_tokens for x in choices), sum(len(x.token_ids) for x in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# ---- the front ----------------------------------------------------------------------------------------
class OpenAIFront:
    """`HttpServer`'s app: answers PATHS on the HTTP threads; generation runs on `loop` (the router's)."""

    def __init__(self, service: Any, loop: asyncio.AbstractEventLoop, served_model_name: str | None = None,
                 chat_template: str | None = None, security: RouterSecurity | None = None) -> None:
        self.service = service
        self.loop = loop
        self.security = security or RouterSecurity()
        self.served_model_name = served_model_name
        tok: TextTokenizer | None = service.tokenizer
        self.chat_template = None
        if chat_template is not None and tok is not None:
            self.chat_template = ChatTemplate(chat_template, _token_text(tok, tok.bos_id),
                                              _token_text(tok, tok.eos_id))
        self.created = int(time.time())
        self.closed = False
        self._runs: set[_Run] = set()
        self._lock = threading.Lock()

    # ---- HttpServer app ----
    def handle(self, req: BaseHTTPRequestHandler) -> bool:
        path = req.path.split("?", 1)[0].rstrip("/")
        if path not in PATHS:
            return False
        ex = _Exchange(req)
        try:
            if not self.security.allows(req.headers.get("Authorization")):
                raise ApiError(401, "missing or unknown API key (expected 'Authorization: Bearer <key>')",
                               "authentication_error", code="invalid_api_key")
            method = "GET" if path == MODELS else "POST"
            if req.command != method:
                raise ApiError(405, f"{path}: expected {method}, got {req.command}", code="method_not_allowed")
            if path == MODELS:
                ex.json(200, self._models())
            else:
                self._generate(ex, self._parse(req, chat=path == CHAT))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except ApiError as e:
            self._fail(ex, e)
        except Exception as e:  # a bug must not kill the server thread silently
            log.exception("%s %s failed", req.command, path)
            self._fail(ex, ApiError(500, f"internal error: {e!r}", "server_error"))
        return True

    def close(self) -> None:
        """Cancels every request in flight (the router is stopping)."""
        self.closed = True
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            run.cancel()

    @staticmethod
    def _fail(ex: _Exchange, e: ApiError) -> None:
        try:
            if ex.started:  # mid-stream: OpenAI clients raise on an event that carries an error
                ex.event(e.body())
            else:
                ex.json(e.status, e.body())
        except OSError:
            pass

    # ---- models ----
    def model_id(self) -> str:
        """`--served-model-name`, else the name of the model directory the decode workers serve."""
        if self.served_model_name:
            return self.served_model_name
        info = self.service.decode_pool.model_info()
        if info is None:
            raise ApiError(503, "no decode worker has reported its model yet", "server_error", code="unavailable")
        return Path(info.model.model.rstrip("/")).name or info.model.model

    def _models(self) -> dict:
        info = self.service.decode_pool.model_info()
        card = {"id": self.model_id(), "object": "model", "created": self.created, "owned_by": "baton"}
        if info is not None and info.model.max_model_len:
            card["max_model_len"] = info.model.max_model_len
        return {"object": "list", "data": [card]}

    # ---- parsing ----
    def _parse(self, req: BaseHTTPRequestHandler, chat: bool) -> _Job:
        try:
            n = int(req.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if not 0 < n <= MAX_BODY_BYTES:
            raise ApiError(400, f"body: expected a JSON object of 1 to {MAX_BODY_BYTES} bytes with a Content-Length")
        try:
            body = json.loads(req.rfile.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"body: expected a JSON object, got invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("body", "a JSON object", type(body).__name__)
        model = self.model_id()
        if body.get("model") not in (None, model):
            raise ApiError(404, f"The model `{body['model']}` does not exist (this server serves `{model}`).",
                           param="model", code="model_not_found")
        tok: TextTokenizer | None = self.service.tokenizer
        sampling = _sampling(body, chat)
        stops = _stops(body)
        if stops and tok is None:
            raise ApiError(400, "stop: stop strings need the router's tokenizer (start it with --tokenizer); "
                                "send stop_token_ids instead", param="stop")
        if chat:
            prompts = self._chat_prompt(body, tok)
            info = self.service.decode_pool.model_info()
            if not sampling.HasField("max_tokens") and info is not None and info.model.max_model_len:
                # OpenAI's chat default: as many tokens as the context has room for.
                sampling.max_tokens = max(1, info.model.max_model_len - len(prompts[0]))
        else:
            for name in ("echo", "suffix"):
                if body.get(name):
                    raise _unsupported(name, name)
            prompts = _prompts(body.get("prompt"))
        job_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        requests = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if tok is None:
                    raise ApiError(400, "prompt: text prompts need the router's tokenizer (start it with "
                                        "--tokenizer); send token ids instead", param="prompt")
                # Tokenized here, off the router's loop; no BOS is added, as for gRPC text prompts.
                prompt = tok.encode(prompt)
            if not all(0 <= t < 2**32 for t in prompt):
                raise _bad("prompt", "token ids >= 0", [t for t in prompt if not 0 <= t < 2**32][:5])
            requests.append(generation_pb2.GenerateRequest(
                request_id=f"{job_id}-{i}", token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sampling))
        stream = body.get("stream") or False
        options = body.get("stream_options") or {}
        if not isinstance(stream, bool) or not isinstance(options, dict):
            raise _bad("stream", "a boolean (and stream_options an object)", body.get("stream"))
        return_ids = body.get("return_token_ids") or False
        return _Job(job_id, chat, model, requests, stream, bool(options.get("include_usage")), bool(return_ids),
                    stops)

    def _chat_prompt(self, body: dict, tok: TextTokenizer | None) -> list[list[int]]:
        if self.chat_template is None or tok is None:
            raise ApiError(400, f"model `{self.model_id()}` has no chat template (no `chat_template` in its "
                                f"{TOKENIZER_CONFIG_FILE}, or the router has no tokenizer): use /v1/completions",
                           param="messages", code="no_chat_template")
        if body.get("tools") or body.get("functions"):
            raise _unsupported("tools", "tool calling")
        fmt = body.get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise _unsupported("response_format", "a response format other than text")
        text = self.chat_template.render(_messages(body), add_generation_prompt=True)
        return [tok.encode(text)]

    # ---- generating ----
    def _generate(self, ex: _Exchange, job: _Job) -> None:
        if self.closed:
            raise ApiError(503, "the router is shutting down", "server_error", code="unavailable")
        run = _Run(self, job.requests)
        with self._lock:
            self._runs.add(run)
        choices = [_Choice(len(r.token_ids.ids), _StopMatcher(job.stops)) for r in job.requests]
        sock = ex.req.connection
        try:
            ended = 0
            while ended < len(choices):
                i, kind, item = run.next(lambda: _peer_gone(sock))
                if kind == _END:
                    ended += 1
                    continue
                if kind == _ERROR:
                    run.cancel()
                    raise item
                c = choices[i]
                if c.done:  # a stop string already ended it: what was in flight is dropped
                    continue
                ids = list(item.token_ids)
                c.token_ids += ids
                final = item.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
                text, matched = c.matcher.push(item.text, final)
                if matched:
                    c.finish_reason = "stop"
                    run.finish(i)
                elif final:
                    c.finish_reason = FINISH_FROM_PROTO.get(item.finish_reason, "stop")
                c.text.append(text)
                if job.stream and (text or ids or c.done):
                    self._chunk(ex, job, i, c, text, ids)
            if job.stream:
                if job.include_usage:
                    ex.event(self._envelope(job, [], usage=_usage(choices)))
                ex.event("[DONE]")
            else:
                ex.json(200, self._envelope(job, [self._full(job, i, c) for i, c in enumerate(choices)],
                                            usage=_usage(choices)))
        except (_ClientGone, BrokenPipeError, ConnectionResetError):
            # 499: nobody to answer; the Generate calls are cancelled, which aborts them on the nodes.
            log.info("client of %s went away: request cancelled", job.id)
            run.cancel()
        except BaseException:
            run.cancel()
            raise
        finally:
            with self._lock:
                self._runs.discard(run)

    def _envelope(self, job: _Job, choices: list[dict], usage: dict | None = None, chunk: bool = False) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
        out: dict[str, Any] = {"id": job.id, "object": obj, "created": job.created, "model": job.model,
                               "choices": choices}
        if usage is not None or not chunk or job.include_usage:
            out["usage"] = usage
        return out

    def _full(self, job: _Job, i: int, c: _Choice) -> dict:
        text = "".join(c.text)
        out: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": c.finish_reason}
        if job.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        if job.return_token_ids:
            out["token_ids"] = c.token_ids
        return out

    def _chunk(self, ex: _Exchange, job: _Job, i: int, c: _Choice, text: str, ids: list[int]) -> None:
        out: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": c.finish_reason}
        if job.chat:
            delta: dict[str, Any] = {}
            if not c.started:
                c.started = True
                delta["role"] = "assistant"
            if text or "role" in delta:
                delta["content"] = text
            out["delta"] = delta
        else:
            out["text"] = text
        if job.return_token_ids:
            out["token_ids"] = ids
        ex.event(self._envelope(job, [out], chunk=True))
