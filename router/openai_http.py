"""OpenAI-compatible HTTP front of the router: `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/models`, `GET /v1/models/{id}`, on the router's HTTP port (README.md "OpenAI-compatible HTTP"), served by
`asgi_server.py` on the router's event loop.

Every request runs through `GenerationService.Generate`, as a gRPC call does (validation, routing, retries,
metrics, cancellation): one Generate task per prompt, with a stand-in for the gRPC context whose `write`
puts messages into a queue that the handler turns into the HTTP answer. A client that goes away (its
disconnect, or a write stalled past `--http-write-timeout-s`) cancels those tasks: the request is aborted on
the nodes exactly as a cancelled gRPC stream is. Stop strings and `n` travel in the Generate requests: the
service matches stop strings (`stop_strings.py`), and n choices of a prompt are n requests (`choices.py`).

CPU-bound work of a request (decoding its JSON, tokenizing its prompts, rendering the chat template) runs on
a few worker threads, never on the loop. Limits (`http_limits.py`): a request takes one of
`--http-max-in-flight` slots while it is read and parsed, one per generation while it runs (429 with
`retry-after` when they are taken); `--max-choices` caps its generations; `--max-request-bytes` its body.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}` (`http_errors.py`), with the
HTTP status of the gRPC status the service ended with (INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429,
UNAVAILABLE 503, DEADLINE_EXCEEDED 504, ...). A body field Baton does not implement is refused, never ignored
(`http_fields.py`). A generation request refused here, before any Generate call, counts as outcome "invalid" in
`baton_router_requests_total`, as the service's own refusals do.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from baton.engine.tokenizer import TOKENIZER_CONFIG_FILE, TextTokenizer
from baton.proto.convert import FINISH_FROM_PROTO
from baton.proto.v1 import generation_pb2
from baton.router import http_openai_request as rq
from baton.router import metrics as rm
from baton.router.choices import fan_out
from baton.router.http_chat_template import ChatTemplate, load_chat_template
from baton.router.http_errors import ApiError, busy, shutting_down
from baton.router.http_exchange import ClientGone, Exchange
from baton.router.http_fields import CHAT as CHAT_FIELDS
from baton.router.http_fields import COMPLETIONS as COMPLETION_FIELDS
from baton.router.http_fields import check_fields
from baton.router.http_json import decode_object
from baton.router.http_limits import HttpLimits
from baton.router.http_logprobs import CompletionLogprobs, TokenTexts, chat_content, merge
from baton.router.http_structured import AutoToolCalls, response_format, tool_choice
from baton.router.security import RouterSecurity
from baton.router.tool_call_parser import ToolCallSplitter
from baton.router.tool_syntax import detect

__all__ = ["PATHS", "OpenAIFront", "load_chat_template"]

log = logging.getLogger(__name__)

COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
PATHS = (COMPLETIONS, CHAT, MODELS)
# `GET /v1/models/{id}`: the id may hold slashes ("org/name").
MODEL_PREFIX = MODELS + "/"
# Refusals that are the request's fault (outcome "invalid"); 401, 429 and 503 are not.
_INVALID_STATUSES = frozenset({400, 404, 405, 408, 413})
# Threads for requests' CPU-bound parsing: few, so that held requests never add threads.
PARSE_THREADS = 4


def _token_text(tok: TextTokenizer, i: int | None) -> str:
    return (tok.tokenizer.id_to_token(i) or "") if i is not None else ""


# ---- the Generate calls of one request ----------------------------------------------------------------
_MSG, _ERROR, _END, _GONE = "msg", "error", "end", "gone"


class _ContextAborted(Exception):
    pass


class _Context:
    """What `GenerationService.Generate` needs of a `grpc.aio.ServicerContext`; feeds the handler's queue.
    Its metadata carries the HTTP request's API key: the service counts and scopes it as that key's call."""

    def __init__(self, put: Callable[[tuple], None], index: int, authorization: str | None) -> None:
        self._put, self._index = put, index
        self._metadata = (("authorization", authorization),) if authorization is not None else ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def write(self, msg: generation_pb2.GenerateResponse) -> None:
        self._put((self._index, _MSG, msg))

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._put((self._index, _ERROR, ApiError.of_grpc(code, details)))
        raise _ContextAborted(details)

    def time_remaining(self) -> float | None:
        return None


class _Run:
    """The Generate tasks of one HTTP request, on the router's loop; their messages arrive in `queue`."""

    def __init__(self, service: Any, requests: Sequence[generation_pb2.GenerateRequest],
                 authorization: str | None) -> None:
        self.service = service
        self.authorization = authorization
        self.request_ids = [r.request_id for r in requests]
        self.queue: asyncio.Queue[tuple] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._one(i, r), name=r.request_id) for i, r in enumerate(requests)]

    async def _one(self, i: int, request: generation_pb2.GenerateRequest) -> None:
        try:
            await self.service.Generate(request, _Context(self.queue.put_nowait, i, self.authorization))
        except _ContextAborted:
            pass
        except asyncio.CancelledError:
            # Only the router's shutdown leaves a reader to tell (a client that left reads nothing).
            self.queue.put_nowait((i, _ERROR, shutting_down()))
            raise
        except Exception as e:  # a bug: the client still gets an answer
            log.exception("request %s failed", request.request_id)
            self.queue.put_nowait((i, _ERROR, ApiError(500, f"internal error: {e!r}", "server_error")))
        finally:
            self.queue.put_nowait((i, _END, None))

    def gone(self) -> None:
        self.queue.put_nowait((-1, _GONE, None))

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


@dataclass
class _Choice:
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # chat streams: the role delta was sent (completions with echo: the prompt was sent)
    prompt_ids: Sequence[int] = ()
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    legacy: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    splitter: ToolCallSplitter | None = None  # chat streams with tool_choice "auto": content and calls so far

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _calls_finish(reason: str | None) -> str | None:
    """A choice that called tools finishes with "tool_calls", unless it was cut short."""
    return "tool_calls" if reason == "stop" else reason


def _usage(choices: Sequence[_Choice]) -> dict:
    p, c = sum(x.prompt_tokens for x in choices), sum(len(x.token_ids) for x in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# ---- the front ----------------------------------------------------------------------------------------
class OpenAIFront:
    """The OpenAI paths of the router's ASGI app (`asgi_app.py`); everything runs on the router's loop."""

    def __init__(self, service: Any, chat_template: str | None = None,
                 security: RouterSecurity | None = None, limits: HttpLimits | None = None) -> None:
        self.service = service
        self.security = security or RouterSecurity()
        self.limits = limits or HttpLimits()
        tok: TextTokenizer | None = service.tokenizer
        self.chat_template = None
        if chat_template is not None and tok is not None:
            self.chat_template = ChatTemplate(chat_template, _token_text(tok, tok.bos_id),
                                              _token_text(tok, tok.eos_id))
        # How the template writes an assistant's tool calls (what tool_choice "auto" lets the model write).
        self.tool_syntax = detect(chat_template) if self.chat_template is not None else None
        if self.tool_syntax is not None:
            added = {t.content for t in tok.tokenizer.get_added_tokens_decoder().values()}
            self.tool_syntax = self.tool_syntax.for_tokenizer(added)
        self.created = int(time.time())
        self.closed = False
        self.in_flight = 0  # slots of `limits.max_in_flight` taken
        self._runs: set[_Run] = set()
        self._executor = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="baton-http-parse")
        self._texts = TokenTexts(tok)

    # ---- the ASGI app's front ----
    def claims(self, path: str) -> bool:
        return path in PATHS or path.startswith(MODEL_PREFIX)

    async def handle(self, ex: Exchange) -> None:
        path = ex.path.rstrip("/")
        if not self.security.allows(ex.header("authorization")):
            raise ApiError(401, "missing or unknown API key (expected 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")
        if path == MODELS or path.startswith(MODEL_PREFIX):
            if ex.method != "GET":
                raise ApiError(405, f"{path[:200]}: expected GET, got {ex.method[:20]}")
            await ex.json(200, self._models() if path == MODELS else self._model(path.removeprefix(MODEL_PREFIX)))
            return
        try:
            if ex.method != "POST":
                raise ApiError(405, f"{path}: expected POST, got {ex.method[:20]}")
            if self.closed:
                raise shutting_down()
            held = self._take(1, "requests")
        except ApiError as e:
            self._count_refusal(e)
            raise
        try:
            try:
                body = await ex.body()
                loop = asyncio.get_running_loop()
                job = await loop.run_in_executor(self._executor, self._parse, body, path == CHAT)
                held += self._take(len(job.requests) - 1, "generations")
            except ApiError as e:
                self._count_refusal(e)
                raise
            await self._generate(ex, job)
        finally:
            self.in_flight -= held

    def _count_refusal(self, e: ApiError) -> None:
        """A generation request answered before any Generate call: counted as the service counts its own."""
        outcome = rm.INVALID if e.status in _INVALID_STATUSES else rm.ERROR
        self.service.metrics.requests.labels(outcome=outcome).inc()

    def _take(self, n: int, what: str) -> int:
        if self.in_flight + n > self.limits.max_in_flight:
            raise busy(f"{what} in flight over HTTP (--http-max-in-flight {self.limits.max_in_flight})")
        self.in_flight += n
        return n

    def drain(self) -> None:
        self.closed = True

    def close(self) -> None:
        """Cancels every request in flight (the router is stopping)."""
        self.closed = True
        for run in list(self._runs):
            run.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- models ----
    def model_id(self) -> str:
        """`--served-model-name`, else the name of the model directory the decode workers serve."""
        name = self.service.model_name()
        if name is None:
            raise ApiError(503, "no decode worker has reported its model yet", "server_error", code="unavailable")
        return name

    def _card(self) -> dict:
        info = self.service.decode_pool.model_info()
        card = {"id": self.model_id(), "object": "model", "created": self.created, "owned_by": "baton"}
        if info is not None and info.model.max_model_len:
            card["max_model_len"] = info.model.max_model_len
        return card

    def _models(self) -> dict:
        return {"object": "list", "data": [self._card()]}

    def _model(self, model_id: str) -> dict:
        card = self._card()
        if model_id != card["id"]:
            raise ApiError(404, f"The model `{model_id[:200]}` does not exist (this server serves `{card['id']}`).",
                           param="model", code="model_not_found")
        return card

    # ---- parsing (on a worker thread) ----
    def _parse(self, raw: bytes, chat: bool) -> rq.Job:
        if not raw:
            raise ApiError(400, "body: expected a JSON object, got an empty body", param="body")
        body = decode_object(raw, self.limits.max_json_depth)
        model = self.model_id()
        rq.check_model(body, model)
        check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        tok: TextTokenizer | None = self.service.tokenizer
        sampling = rq.sampling(body, chat)
        n = rq.choices(body, self.limits.max_choices)
        stops = rq.stops(body)
        stream, include_usage, continuous_usage = rq.stream_options(body)
        return_ids = rq.opt_bool(body, "return_token_ids")
        top, echo = rq.logprobs(body, chat, self.service.flow.config.max_logprobs)
        if top is not None:
            sampling.logprobs = top
            if echo:  # the echoed prompt comes with its logprobs
                sampling.prompt_logprobs = top
        grammar = response_format(body)
        calls, tools, forced = tool_choice(body, self.tool_syntax) if chat else (None, None, None)
        if forced is not None or grammar is not None:
            sampling.structured_output.CopyFrom(forced or grammar)
        if stops and tok is None:
            raise ApiError(400, "stop: stop strings need the router's tokenizer (start it with --tokenizer); "
                                "send stop_token_ids instead", param="stop")
        info = self.service.decode_pool.model_info()
        max_model_len = info.model.max_model_len if info is not None else 0
        if chat:
            prompts: list = self._chat_prompt(body, tok, tools)
            if not sampling.HasField("max_tokens") and max_model_len:
                # OpenAI's chat default: as many tokens as the context has room for.
                sampling.max_tokens = max(1, max_model_len - len(prompts[0]))
        else:
            prompts = rq.prompts(body.get("prompt"))
            if len(prompts) * n > self.limits.max_choices:
                raise ApiError(400, f"prompt: expected at most {self.limits.max_choices} generations (n x prompts, "
                                    f"--max-choices), got {n} x {len(prompts)}", param="prompt",
                               code="too_many_choices")
        rq.check_sampling(sampling)
        job_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        requests = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if tok is None:
                    raise ApiError(400, "prompt: text prompts need the router's tokenizer (start it with "
                                        "--tokenizer); send token ids instead", param="prompt")
                # No BOS is added, as for gRPC text prompts.
                prompt = tok.encode(prompt)
            rq.check_ids(prompt)
            rq.check_room(rq.max_tokens_field(body, chat), sampling.max_tokens, len(prompt), max_model_len)
            one = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sampling,
                                                 stop=stops)
            # OpenAI's order: the n choices of prompt 0, then prompt 1's, ...; each choice its own Generate call.
            for r in fan_out(one, n):
                r.request_id = f"{job_id}-{len(requests)}"
                requests.append(r)
        return rq.Job(job_id, chat, model, requests, stream, include_usage, return_ids, logprobs=top, echo=echo,
                      tool_calls=calls, continuous_usage=continuous_usage)

    def _chat_prompt(self, body: dict, tok: TextTokenizer | None, tools: list[dict] | None = None
                     ) -> list[list[int]]:
        if self.chat_template is None or tok is None:
            raise ApiError(400, f"model `{self.model_id()}` has no chat template (no `chat_template` in its "
                                f"{TOKENIZER_CONFIG_FILE}, or the router has no tokenizer): use /v1/completions",
                           param="messages", code="no_chat_template")
        text = self.chat_template.render(rq.messages(body), add_generation_prompt=True, tools=tools)
        return [tok.encode(text)]

    # ---- generating ----
    async def _generate(self, ex: Exchange, job: rq.Job) -> None:
        run = _Run(self.service, job.requests, ex.header("authorization"))
        self._runs.add(run)
        watch = asyncio.create_task(ex.wait_gone())
        watch.add_done_callback(lambda t: t.cancelled() or run.gone())
        try:
            await self._answer(ex, job, run)
        except ClientGone:
            # 499: nobody to answer; the Generate calls are cancelled, which aborts them on the nodes.
            log.info("client of %s went away: request cancelled", job.id)
        finally:
            watch.cancel()
            run.cancel()
            self._runs.discard(run)

    async def _answer(self, ex: Exchange, job: rq.Job, run: _Run) -> None:
        choices = [_Choice(len(r.token_ids.ids), prompt_ids=r.token_ids.ids) for r in job.requests]
        ended = 0
        while ended < len(choices):
            i, kind, item = await run.queue.get()
            if kind == _GONE:
                raise ClientGone
            if kind == _END:
                ended += 1
                continue
            if kind == _ERROR:
                raise item
            c = choices[i]
            ids = list(item.token_ids)
            c.token_ids += ids
            c.logprobs += item.logprobs
            c.prompt_logprobs += item.prompt_logprobs
            # (Stop strings are matched by the service: its text stops before a match, which ends the request.)
            text = item.text
            if item.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                c.finish_reason = FINISH_FROM_PROTO.get(item.finish_reason, "stop")
            c.text.append(text)
            if job.stream and (text or ids or c.done or (job.echo and not c.started)):
                await self._chunk(ex, job, i, c, text, ids, item.logprobs,
                                  _usage(choices) if job.continuous_usage else None)
        if job.stream:
            if job.include_usage:
                await ex.event(self._envelope(job, [], usage=_usage(choices)))
            await ex.event("[DONE]")
            await ex.end_stream()
        else:
            await ex.json(200, self._envelope(job, [self._full(job, i, c) for i, c in enumerate(choices)],
                                              usage=_usage(choices)))

    def _envelope(self, job: rq.Job, choices: list[dict], usage: dict | None = None, chunk: bool = False) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
        out: dict[str, Any] = {"id": job.id, "object": obj, "created": job.created, "model": job.model,
                               "choices": choices}
        if usage is not None or not chunk or job.include_usage:
            out["usage"] = usage
        return out

    def _echo(self, job: rq.Job, c: _Choice) -> tuple[str, dict | None]:
        """A completions choice's echoed prompt, once: its text and, with logprobs, its legacy entries."""
        c.started = True
        text = self.service.tokenizer.decode(c.prompt_ids) if self.service.tokenizer is not None else ""
        if job.logprobs is None:
            return text, None
        entries = c.legacy.entries(c.prompt_ids[0], c.prompt_logprobs, self._texts)
        # Offsets follow the echoed text (a token's text alone may differ from its part of the whole).
        c.legacy.offset = len(text)
        return text, entries

    def _logprobs(self, job: rq.Job, c: _Choice, items: Sequence[generation_pb2.TokenLogprob],
                  echoed: dict | None = None) -> dict | None:
        """The logprobs object of a choice (or chunk) whose new tokens have `items`; None where none were asked."""
        if job.logprobs is None:
            return None
        if job.chat:
            return {"content": chat_content(items, self._texts), "refusal": None}
        run = c.legacy.entries(None, items, self._texts)
        return run if echoed is None else merge(echoed, run)

    def _full(self, job: rq.Job, i: int, c: _Choice) -> dict:
        text = "".join(c.text)
        echo_text, echoed = self._echo(job, c) if job.echo else ("", None)
        out: dict[str, Any] = {"index": i, "logprobs": self._logprobs(job, c, c.logprobs, echoed),
                               "finish_reason": c.finish_reason}
        if job.chat:
            out["message"] = {"role": "assistant", "content": text}
            if isinstance(job.tool_calls, AutoToolCalls):
                splitter = job.tool_calls.splitter()
                content, calls = splitter.feed(text)
                rest, more = splitter.finish()
                if calls or more:
                    out["message"] = {"role": "assistant", "content": content + rest or None,
                                      "tool_calls": calls + more}
                    out["finish_reason"] = _calls_finish(c.finish_reason)
            elif job.tool_calls is not None and (calls := job.tool_calls.parse(text)) is not None:
                out["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                out["finish_reason"] = "tool_calls"
        else:
            out["text"] = echo_text + text
        if job.return_token_ids:
            out["token_ids"] = c.token_ids
        return out

    async def _chunk(self, ex: Exchange, job: rq.Job, i: int, c: _Choice, text: str, ids: list[int],
                     items: Sequence[generation_pb2.TokenLogprob], usage: dict | None = None) -> None:
        echoed = None
        if job.echo and not c.started:  # the first chunk of a completions choice with echo starts with the prompt
            echo_text, echoed = self._echo(job, c)
            text = echo_text + text
        out: dict[str, Any] = {"index": i, "logprobs": self._logprobs(job, c, items, echoed),
                               "finish_reason": c.finish_reason}
        if job.chat:
            delta: dict[str, Any] = {}
            if not c.started:
                c.started = True
                delta["role"] = "assistant"
            if isinstance(job.tool_calls, AutoToolCalls):
                if c.splitter is None:
                    c.splitter = job.tool_calls.splitter()
                made = len(c.splitter.calls)
                content, calls = c.splitter.feed(text)
                if c.done:
                    rest, more = c.splitter.finish()
                    content, calls = content + rest, calls + more
                    if c.splitter.calls:
                        out["finish_reason"] = _calls_finish(c.finish_reason)
                if content:
                    delta["content"] = content
                if calls:
                    # Each call goes out whole once its block has closed.
                    delta["tool_calls"] = [{"index": made + k, **call} for k, call in enumerate(calls)]
                if not delta and not c.done and not items:
                    return
            elif job.tool_calls is not None:
                # The calls go out whole, with the last chunk: a partial call's JSON is not yet a call.
                calls = job.tool_calls.parse("".join(c.text)) if c.done else None
                if calls is not None:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                    out["finish_reason"] = "tool_calls"
                elif c.done:
                    delta["content"] = "".join(c.text)
                elif "role" not in delta:
                    return
            elif text or "role" in delta:
                delta["content"] = text
            out["delta"] = delta
        else:
            out["text"] = text
        if job.return_token_ids:
            out["token_ids"] = ids
        await ex.event(self._envelope(job, [out], usage=usage, chunk=True))
