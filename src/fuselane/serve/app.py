"""The ASGI application: OpenAI's routes over the engine, the API key, streams, and one log line a request.

Routes: `GET /health` (open: the engine's counts, KV blocks in use among them), and under `/v1` (behind the
API key when the server has one) `GET /models`, `GET /models/{id}`, `POST /chat/completions` and
`POST /completions`. Every error is OpenAI's error JSON: 400 for a bad request, 401 for a wrong or missing key,
404/405 for an unknown route or method, 413 for a body past `MAX_BODY_BYTES`, 429 when the engine's queue is
full. A client that goes away before its reply ends (mid-stream, or while waiting for a whole reply) cancels
its sequence, whose blocks go back to the pool before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from fuselane.engine.engine import Engine, QueueFull
from fuselane.engine.sequence import Event
from fuselane.engine.sequence import Request as Generate
from fuselane.errors import FuselaneError
from fuselane.serve import replies
from fuselane.serve.protocol import Ask, BadRequest, Kind, parse_chat, parse_completion

MAX_BODY_BYTES = 64 << 20  # a request body past this is refused before it is read whole (413)
INVALID = "invalid_request_error"


@dataclass(slots=True)
class Service:
    """What the routes serve: a loaded model, the engine over its lane, the name it is served as."""

    model: Any  # fuselane.runtime.model.Model
    engine: Engine
    name: str
    api_key: str | None = None
    created: int = 0  # when the server started, as OpenAI's `created` (seconds since the epoch)
    say: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))


def _error(status: int, message: str, kind: str = INVALID, *, param: str | None = None, code: str | None = None):
    return JSONResponse(replies.error(message, kind, param=param, code=code), status_code=status)


class _Channel:
    """A sequence's events, carried from the engine's thread into the request's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is left to read it
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def get(self) -> Event:
        return await self.queue.get()


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source, as soon as the client goes: the source's `finally`
    cancels the sequence. (Starlette's own notices a departed client only at its next write, on newer ASGI
    servers.)"""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _disconnected(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class Api:
    """The routes' handlers over one `Service`."""

    def __init__(self, service: Service) -> None:
        self.s = service

    async def health(self, request: Request) -> Response:
        stats = asdict(self.s.engine.stats)
        # read when asked, not at each step: the allocator gathers all its statistics for each read
        memory = self.s.engine.lane.device_bytes()
        return JSONResponse(
            {"status": "ok", "model": self.s.name, "lane": self.s.engine.lane.name, **stats, "device_bytes": memory}
        )

    async def models(self, request: Request) -> Response:
        return self._denied(request) or JSONResponse(
            {"object": "list", "data": [replies.model_card(self.s.name, self.s.created, self.s.model.ctx)]}
        )

    async def model(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        asked = request.path_params["model_id"]
        if asked != self.s.name:
            return _error(404, f"the model '{asked}' is not served here", "not_found_error", code="model_not_found")
        return JSONResponse(replies.model_card(self.s.name, self.s.created, self.s.model.ctx))

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, parse_completion)

    def _denied(self, request: Request) -> Response | None:
        key = self.s.api_key
        if key is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return None
        message = "Incorrect API key provided" if given else "Missing API key: send 'Authorization: Bearer KEY'"
        response = _error(401, message, code="invalid_api_key")
        response.headers["www-authenticate"] = "Bearer"
        return response

    async def _body(self, request: Request) -> Any:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise HTTPException(413, f"the request body passes {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"the request body is not valid JSON: {str(e)[:200]}") from None

    def _prompt(self, ask: Ask) -> list[int]:
        m = self.s.model
        if ask.messages is not None:
            return m.encode_messages(list(ask.messages))
        if ask.ids is not None:
            return list(ask.ids)
        return m.prompt_ids(ask.text or "", raw=True)

    async def _complete(self, request: Request, parse: Callable[[Any], Ask]) -> Response:
        if denied := self._denied(request):
            return denied
        try:
            ask = parse(await self._body(request))
            ids = self._prompt(ask)
        except BadRequest as e:
            return _error(400, str(e), param=e.param)
        except FuselaneError as e:
            return _error(400, str(e))
        reply = replies.Reply(ask.kind, replies.ID_PREFIX[ask.kind] + uuid.uuid4().hex, int(time.time()), self.s.name)
        request.state.id, request.state.prompt = reply.id, len(ids)
        channel = _Channel()
        try:
            generate = Generate(tuple(ids), ask.max_tokens, ask.sampling, ask.stop, ask.ignore_eos)
            seq = self.s.engine.submit(generate, channel.put)
        except QueueFull as e:
            return _error(429, str(e), "rate_limit_error", code="rate_limit_exceeded")
        except FuselaneError as e:
            return _error(400, str(e))
        if ask.stream:
            return _EventStream(self._stream(request, ask, reply, seq, channel), headers={"cache-control": "no-cache"})
        return await self._whole(request, reply, seq, channel)

    async def _whole(self, request: Request, reply: replies.Reply, seq: int, channel: _Channel) -> Response:
        texts: list[str] = []

        async def collect() -> Event:
            while True:
                event = await channel.get()
                texts.append(event.text)
                if event.finish is not None:
                    return event

        done, gone = asyncio.create_task(collect()), asyncio.create_task(_disconnected(request.receive))
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not done.done():  # the client left before the reply was ready
            done.cancel()
            self.s.engine.cancel(seq)
            request.state.finish = "cancelled"
            return Response(status_code=499)
        last = done.result()
        request.state.completion, request.state.finish = last.completion_tokens, last.finish.value
        if last.error:
            return _error(500, last.error, "server_error")
        return JSONResponse(reply.whole("".join(texts), last.finish.value, last.prompt_tokens, last.completion_tokens))

    async def _stream(
        self, request: Request, ask: Ask, reply: replies.Reply, seq: int, channel: _Channel
    ) -> AsyncIterator[str]:
        ended = False
        try:
            if ask.kind is Kind.CHAT:
                yield replies.event(reply.chunk("", role=True))
            while not ended:
                event = await channel.get()
                request.state.completion = event.completion_tokens
                ended = event.finish is not None
                if event.error:
                    request.state.finish = "error"
                    yield replies.event(replies.error(event.error, "server_error"))
                    break
                if event.text:
                    yield replies.event(reply.chunk(event.text))
                if ended:
                    request.state.finish = event.finish.value
                    yield replies.event(reply.chunk(None, event.finish.value))
                    if ask.include_usage:
                        yield replies.event(reply.usage_chunk(event.prompt_tokens, event.completion_tokens))
            yield replies.DONE
        finally:
            if not ended:
                self.s.engine.cancel(seq)
                request.state.finish = "cancelled"


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    kind = "not_found_error" if status == 404 else INVALID if status < 500 else "server_error"
    response = _error(status, f"{request.method} {request.url.path}: {detail}", kind)
    response.headers.update(getattr(exc, "headers", None) or {})  # a 405's Allow
    return response


class _LogLines:
    """One line a request on the log: its id, method, path, status, tokens in and out, seconds, and how a
    completion ended. A stream's line is written when the stream ends."""

    def __init__(self, app: Any, say: Callable[[str], None]) -> None:
        self.app, self.say = app, say

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]
        state = scope.setdefault("state", {})

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            seconds = time.perf_counter() - started
            tail = f" {state['finish']}" if "finish" in state else ""
            self.say(
                f"{state.get('id', '-')} {scope['method']} {scope['path']} {status[0]} "
                f"in={state.get('prompt', 0)} out={state.get('completion', 0)} {seconds:.3f}s{tail}"
            )


def create_app(service: Service) -> Any:
    """The ASGI application over `service`; its lifespan starts the engine's thread and stops it."""
    api = Api(service)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.engine.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(service.engine.stop)

    routes = [
        Route("/health", api.health),
        Route("/v1/models", api.models),
        Route("/v1/models/{model_id:path}", api.model),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.add_exception_handler(Exception, _http_error)
    return _LogLines(app, service.say)
