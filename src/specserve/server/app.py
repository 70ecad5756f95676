"""The FastAPI app: routes, API key, OpenAI-style errors, response counting.

    app = create_app(engine, cfg)     # engine: any ServingEngine; started and stopped by the app's lifespan

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (these three and /server_info
need the API key when one is set), GET /health, GET /metrics, GET /server_info (alias /get_server_info).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.server import responses as r
from specserve.server.completions import ServerState, create_chat_completion, create_completion
from specserve.server.engine_api import ServingEngine
from specserve.server.errors import ApiError
from specserve.server.metrics import CONTENT_TYPE, ResponseCounter, metrics_registry
from specserve.server.serve_config import ServeConfig

log = logging.getLogger("specserve.server")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/server_info",
          "/get_server_info")


class CountResponses:
    """ASGI middleware: count every HTTP response by route and status (500 for an unhandled exception)."""

    def __init__(self, app: ASGIApp, counter: ResponseCounter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.record(scope["path"], int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.counter.record(scope["path"], 500)
            raise


def create_app(engine: ServingEngine, cfg: ServeConfig, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """`on_ready`: called once the engine has started, before the first request is answered."""
    state = ServerState(engine, cfg)
    counter = ResponseCounter(ROUTES)
    registry = metrics_registry(engine.stats, counter.snapshot)  # read at scrape time, one per app

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if on_ready is not None:
            on_ready()
        yield
        await engine.shutdown(cfg.shutdown_timeout)

    app = FastAPI(title="specserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(CountResponses, counter=counter)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return ApiError(400, str(e)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {type(e).__name__}").response()

    def require_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), cfg.api_key.encode()):
            raise ApiError(401, "Missing or invalid API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(require_key)]

    @app.get("/health")
    async def health() -> Response:
        if not engine.ready:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    @app.get("/server_info", dependencies=auth)
    @app.get("/get_server_info", dependencies=auth, include_in_schema=False)
    async def server_info() -> dict[str, Any]:
        st = engine.stats()
        spec: dict[str, Any] = {
            "avg_spec_accept_length": st.avg_accept_length,
            "spec_cumulative_num_accept_tokens": st.spec_accept_length_sum if st.speculative else None,
            "spec_cumulative_num_forward_ct": st.spec_verify_steps if st.speculative else None,
        }
        return {
            **cfg.public(), **engine.describe(), **spec,
            "internal_states": [{**spec, "num_queue_reqs": st.num_waiting, "num_running_reqs": st.num_running}],
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        card = r.ModelCard(id=cfg.model_name, created=state.started, root=engine.describe()["model_path"],
                           max_model_len=engine.max_context)
        return r.ModelList(data=[card]).model_dump()

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await create_completion(state, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request)

    return app
