"""The FastAPI app on rank 0: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics. Handlers validate, tokenize and hand requests to the step loop through the bridge;
results come back on an asyncio queue per HTTP request (one choice per prompt).

Streams are Server-Sent Events ending with `data: [DONE]`. A client that disconnects (its
stream is cancelled, or a non-streaming wait sees the disconnect) aborts its requests, and the
engine frees their KV pages at the next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from dspark_launch.log import logger
from dspark_launch.outputs import CompletionDelta, CompletionOutput
from dspark_launch.serve import protocol as p
from dspark_launch.serve.bridge import RequestBridge
from dspark_launch.serve.errors import APIError, bad_request, from_validation
from dspark_launch.serve.metrics import ServerMetrics
from dspark_launch.serve.requests import (
    ModelInfo,
    chat_prompt,
    check_model,
    check_room,
    completion_prompts,
    sampling_params,
)

DISCONNECT_POLL_S = 0.5  # how often a non-streaming wait checks that its client is still there


def meta_info(out: CompletionOutput) -> p.MetaInfo:
    return p.MetaInfo(accept_lens=out.accept_lens, rounds=len(out.accept_lens),
                      mean_tau=out.mean_tau, prompt_tokens=len(out.prompt_token_ids),
                      completion_tokens=len(out.token_ids), preemptions=out.preemptions,
                      ttft_s=out.ttft_s, stop_reason=out.stop_reason,
                      output_token_ids=out.token_ids)


def usage(outs: list[CompletionOutput]) -> p.Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.token_ids) for o in outs)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=p.PromptTokensDetails(
                       cached_tokens=sum(o.cached_tokens for o in outs)))


def sse(model: BaseModel | str) -> str:
    data = model if isinstance(model, str) else model.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


async def parse(request: Request, kind: type[BaseModel]) -> BaseModel:
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise bad_request(f"the request body is not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(obj).__name__}")
    try:
        return kind.model_validate(obj)
    except ValidationError as err:
        raise from_validation(err) from None


class Handlers:
    def __init__(self, info: ModelInfo, bridge: RequestBridge, metrics: ServerMetrics) -> None:
        self.info = info
        self.bridge = bridge
        self.metrics = metrics

    async def _run(self, request: Request, prompts, params, stream: bool,
                   render: Callable, finish: Callable) -> Response:
        sink: asyncio.Queue = asyncio.Queue()
        rids = self.bridge.submit(prompts, params, sink)
        choice_of = {rid: i for i, rid in enumerate(rids)}
        if stream:
            return StreamingResponse(self._stream(rids, sink, choice_of, render, finish),
                                     media_type="text/event-stream")
        results: dict[int, CompletionOutput] = {}
        clock = asyncio.get_running_loop().time
        check_at = clock() + DISCONNECT_POLL_S
        try:
            while len(results) < len(rids):
                # Results arrive every step while a request runs, so look for a vanished
                # client by the clock, not only when the queue is quiet.
                if clock() >= check_at:
                    if await request.is_disconnected():
                        break
                    check_at = clock() + DISCONNECT_POLL_S
                try:
                    delta: CompletionDelta = await asyncio.wait_for(sink.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                if isinstance(delta, APIError):  # the server stops under it (bridge.fail_open)
                    raise delta
                if delta.finished is not None:
                    results[choice_of[delta.rid]] = delta.finished
        finally:
            for rid, i in choice_of.items():
                if i not in results:
                    self.bridge.abort(rid)
        if len(results) < len(rids):  # the client went away; nobody reads an answer
            return Response(status_code=499)
        outs = [results[i] for i in range(len(rids))]
        refused = [o for o in outs if o.error is not None]
        if refused:
            raise bad_request(refused[0].error, "prompt")
        return JSONResponse(finish(outs).model_dump())

    async def _stream(self, rids, sink, choice_of, render, finish) -> AsyncIterator[str]:
        open_ = set(rids)
        done: list[CompletionOutput] = []
        try:
            while open_:
                delta: CompletionDelta = await sink.get()
                if isinstance(delta, APIError):  # the server stops under it (fail_open)
                    yield sse(json.dumps(delta.body()))
                    return  # the error is the last event: no usage, no [DONE]
                if delta.text or delta.finished is not None:
                    yield sse(render(choice_of[delta.rid], delta))
                if delta.finished is not None:
                    open_.discard(delta.rid)
                    done.append(delta.finished)
            tail = finish(done)
            if tail is not None:
                yield sse(tail)
            yield sse("[DONE]")
        finally:
            for rid in open_:  # the client went away (or the server stops): abort the rest
                self.bridge.abort(rid)

    async def completions(self, request: Request) -> Response:
        req = await parse(request, p.CompletionRequest)
        check_model(req.model, self.info)
        params = sampling_params(req, self.info, req.max_tokens)
        prompts = await asyncio.to_thread(completion_prompts, req, self.info)  # tokenizes
        if req.max_tokens is not None:  # else the default, cut to what fits
            for ids, _ in prompts:
                check_room(ids, params.max_tokens, self.info, "prompt", "max_tokens")
        rid, created, model = p.new_id("cmpl"), p.now(), self.info.name
        echo = {i: (text or self.info.tokenizer.decode(ids)) if req.echo else ""
                for i, (ids, text) in enumerate(prompts)}

        def chunk(index: int, delta: CompletionDelta) -> p.CompletionResponse:
            out = delta.finished
            text = delta.text
            if req.echo and echo.get(index) is not None:
                text, echo[index] = echo[index] + text, None
            return p.CompletionResponse(id=rid, created=created, model=model, choices=[
                p.CompletionChoice(index=index, text=text,
                                   finish_reason=out.finish_reason if out else None,
                                   meta_info=meta_info(out) if out else None)])

        def whole(outs: list[CompletionOutput]) -> p.CompletionResponse:
            return p.CompletionResponse(id=rid, created=created, model=model, choices=[
                p.CompletionChoice(index=i, text=echo[i] + o.text, finish_reason=o.finish_reason,
                                   meta_info=meta_info(o)) for i, o in enumerate(outs)],
                usage=usage(outs))

        def stream_tail(outs: list[CompletionOutput]):
            if req.stream_options and req.stream_options.include_usage:
                return p.CompletionResponse(id=rid, created=created, model=model, choices=[],
                                            usage=usage(outs))
            return None

        return await self._run(request, prompts, params, req.stream, chunk,
                               stream_tail if req.stream else whole)

    async def chat(self, request: Request) -> Response:
        req = await parse(request, p.ChatCompletionRequest)
        check_model(req.model, self.info)
        name = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = getattr(req, name)
        params = sampling_params(req, self.info, max_tokens, name)
        ids, text = await asyncio.to_thread(chat_prompt, req, self.info)  # renders, tokenizes
        if max_tokens is not None:
            check_room(ids, params.max_tokens, self.info, "messages", name)
        rid, created, model = p.new_id("chatcmpl"), p.now(), self.info.name
        first = [True]

        def chunk(index: int, delta: CompletionDelta) -> p.ChatCompletionChunk:
            out = delta.finished
            role = "assistant" if first[0] else None
            first[0] = False
            return p.ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                p.ChatChunkChoice(index=index, delta=p.ChatDelta(role=role, content=delta.text),
                                  finish_reason=out.finish_reason if out else None,
                                  meta_info=meta_info(out) if out else None)])

        def whole(outs: list[CompletionOutput]) -> p.ChatCompletionResponse:
            return p.ChatCompletionResponse(id=rid, created=created, model=model, choices=[
                p.ChatChoice(index=i, message=p.ChatMessageOut(content=o.text),
                             finish_reason=o.finish_reason, meta_info=meta_info(o))
                for i, o in enumerate(outs)], usage=usage(outs))

        def stream_tail(outs: list[CompletionOutput]):
            if req.stream_options and req.stream_options.include_usage:
                return p.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                             usage=usage(outs))
            return None

        return await self._run(request, [(ids, text)], params, req.stream, chunk,
                               stream_tail if req.stream else whole)


def build_app(info: ModelInfo, bridge: RequestBridge, metrics: ServerMetrics,
              health: Callable[[], bool]) -> FastAPI:
    """`health()` is False once the server stops accepting requests (shutdown)."""
    app = FastAPI(title="dspark-launch", docs_url=None, redoc_url=None)
    handlers = Handlers(info, bridge, metrics)
    created = p.now()

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        metrics.refused(err.status)
        return err.response()

    @app.exception_handler(404)
    async def not_found(request: Request, _) -> JSONResponse:
        return APIError(404, f"no route {request.method} {request.url.path}",
                        code="not_found").response()

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception) -> JSONResponse:
        # A bug of this server's, not the client's: still an OpenAI error body (the
        # traceback goes to the log), not a plain-text 500.
        logger.exception("internal error answering a request")
        metrics.refused(500)
        return APIError(500, f"internal server error: {type(err).__name__}: {err}",
                        type="server_error", code="internal_error").response()

    @app.exception_handler(405)
    async def bad_method(request: Request, _) -> JSONResponse:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()

    app.post("/v1/completions")(handlers.completions)
    app.post("/v1/chat/completions")(handlers.chat)

    card = p.ModelCard(id=info.name, created=created, max_model_len=info.context_limit)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> JSONResponse:
        check_model(name, info)
        return JSONResponse(card.model_dump())

    @app.get("/health")
    async def health_check() -> Response:
        return Response(status_code=200 if health() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
