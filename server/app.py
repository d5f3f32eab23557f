"""The HTTP layer of `tandem serve`: OpenAI's endpoints, the job API, detection, health and
metrics, over a backend (backends.py). It only translates: requests are checked here
(protocol.py), the work runs in the workers or the embedded Runtime.

    POST /v1/completions, /v1/chat/completions     OpenAI, JSON or server-sent events   routes/completions.py
    GET  /v1/models
    POST /v1/jobs   GET /v1/jobs/{id}   GET /v1/jobs/{id}/events   DELETE /v1/jobs/{id}  routes/jobs.py
    POST /v1/detect                                 an uploaded image, or {"url"} / {"path"}  routes/detect.py
    GET  /health    GET /metrics                                                          routes/health.py
    GET  /openapi.json                              the request bodies' schemas           openapi.py

With an API key (`--api-key`, TANDEM_API_KEY), every endpoint but /health wants it as a Bearer
token (server/common.py require_api_key).

A client that goes away cancels its work: a stream's generator is closed by the server when
the client disconnects; a plain request's wait races a disconnect watch (server/common.py).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from server import protocol
from server.common import ClientGone, ServeConfig, ServerContext, log, require_api_key
from server.protocol import APIError
from server.routes import completions, detect, health, jobs, models

__all__ = ["ServeConfig", "create_app"]


def create_app(backend, config: ServeConfig | None = None) -> FastAPI:
    ctx = ServerContext(backend, config or ServeConfig())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        if ctx.background:
            await asyncio.gather(*ctx.background, return_exceptions=True)
        await backend.close()

    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.backend = backend
    app.state.tandem = ctx
    _add_error_handlers(app)
    for group in (models, completions, jobs, detect):
        app.include_router(group.router, dependencies=[Depends(require_api_key)])
    app.include_router(health.router)  # /health answers anyone; /metrics checks the key itself
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ValueError)
    async def _value_error(_request: Request, exc: ValueError) -> JSONResponse:
        err = protocol.field_error(exc)  # a FieldError's field and code; protocol.fallback_param else
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, _exc: ClientGone) -> Response:
        # One line, no traceback: a client going away is ordinary, and its work was cancelled.
        log.info(
            "client went away before its answer to %s %s; its work was cancelled", request.method, request.url.path
        )
        return Response(status_code=499)  # nobody to answer

    async def _redis_down(_request: Request, exc: Exception) -> JSONResponse:
        # A Redis restart, usually: worth a retry, and no reason for a traceback per request.
        err = APIError(503, f"the job store (Redis) is unreachable: {exc}", headers={"Retry-After": "2"})
        return JSONResponse(err.body(), status_code=503, headers=err.headers)

    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    app.add_exception_handler(RedisConnectionError, _redis_down)
    app.add_exception_handler(RedisTimeoutError, _redis_down)

    @app.exception_handler(Exception)
    async def _internal(request: Request, _exc: Exception) -> JSONResponse:
        # One request's bug, not the server's end. (A plain exception handler, not an HTTP
        # middleware: Starlette's BaseHTTPMiddleware would hide a client's disconnect.)
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, "internal server error", type_="server_error").body(), status_code=500)
