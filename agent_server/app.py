"""The Starlette application: routes, errors, auth, metrics, and startup/shutdown.

`create_app(config, engine_factory)` returns the ASGI app. The engine is built in the
background at startup so /health answers at once and /ready turns 200 when the model is
loaded; until then model endpoints answer 503.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent_server import playground
from agent_server.agent.tool_registry import ToolRegistry
from agent_server.auth import ApiKeyMiddleware
from agent_server.chat import routes as chat_routes
from agent_server.conversations import routes as conversations_routes
from agent_server.cross_site import CrossSiteGuard
from agent_server.errors import APIError, UnexpectedErrorMiddleware, internal_error, not_found
from agent_server.metrics import Metrics, MetricsMiddleware
from agent_server.request_ids import RequestIdMiddleware, current_request_id, new_request_id
from agent_server.responses import dialect
from agent_server.responses import routes as responses_routes
from agent_server.responses import websocket as responses_websocket
from agent_server.state import ServerConfig, ServerState
from agent_server.store import ResponseStore, SQLiteResponseStore
from inference.request import EngineClient
from tools.servers import ToolServerError

log = logging.getLogger(__name__)


def warm_up() -> None:
    """Load tokenizer tables and build the SDK's models now, not during the first request."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from agent_server.responses import events as response_events
    from agent_server.token_bytes import token_bytes
    from inference.tokenizer import harmony_encoding

    harmony_encoding()
    token_bytes(0)
    response_events.warm_up()
    header = {"id": "x", "created": 0, "model": "m"}
    ChatCompletionChunk.model_validate(
        {
            **header,
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "x"},
                    "finish_reason": None,
                    "logprobs": {"content": [{"token": "x", "bytes": [120], "logprob": 0.0, "top_logprobs": []}]},
                }
            ],
        }
    )
    ChatCompletion.model_validate(
        {
            **header,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x"},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
        }
    )


EngineFactory = Callable[[], "EngineClient | Awaitable[EngineClient]"]
ToolServersFactory = Callable[[], Awaitable[list[Any]]]


def engine_failed(state: ServerState) -> Response | None:
    """503 with the reason once the engine can no longer serve (an engine process that exited)."""
    failure = getattr(state.engine, "failure", None)
    return JSONResponse({"status": "failed", "error": failure}, status_code=503) if failure else None


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    error = state.extra.get("load_error")
    if error:  # the server cannot serve: a restart (with a fixed configuration) is what helps
        return JSONResponse({"status": "failed", "error": error}, status_code=503)
    failed = engine_failed(state)
    if failed is not None:
        return failed
    body: dict[str, Any] = {"status": "ok"}
    router = state.engine
    if getattr(router, "replica_stats", None) is not None:  # data parallel: a lost replica shows here
        live = router.live()
        body["replicas"] = {"total": len(router.replicas), "in_rotation": len(live)}
        if len(live) < len(router.replicas):
            body["status"] = "degraded"
            body["replicas"]["out"] = {
                str(i): router.replicas[i].failure for i in range(len(router.replicas)) if i not in live
            }
    return JSONResponse(body)


async def ready(request: Request) -> Response:
    state: ServerState = request.app.state.server
    failed = engine_failed(state)
    if failed is not None:
        return failed
    if state.ready:
        return JSONResponse({"status": "ready", "model": state.config.model_name})
    error = state.extra.get("load_error")
    return JSONResponse({"status": "failed" if error else "loading", "error": error}, status_code=503)


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    return {
        "id": state.config.model_name,
        "object": "model",
        "created": int(state.extra.get("loaded_at", time.time())),
        "owned_by": "oss-agent",
        "context_length": engine.max_model_len if engine else None,
        "max_model_len": engine.max_model_len if engine else None,
        # (not OpenAI's: what a client should know about this server's model)
        "random_weights": state.config.random_weights,
        "default_max_output_tokens": state.config.default_max_output_tokens,
    }


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def retrieve_model(request: Request) -> Response:
    state: ServerState = request.app.state.server
    model = request.path_params["model"]
    if not state.config.serves(model):
        raise not_found("Model", model, param="model")
    return JSONResponse(_model_card(state))


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {
        404: f"No route {request.method} {request.url.path}.",
        405: f"Method {request.method} is not allowed on {request.url.path}.",
    }.get(exc.status_code, str(exc.detail))
    return APIError(message, status=exc.status_code, code="not_found" if exc.status_code == 404 else None).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Last resort (UnexpectedErrorMiddleware catches route errors): Starlette answers this
    # outside the other middleware, so the request id header is set here.
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    response = internal_error().response()
    response.headers["x-request-id"] = current_request_id.get() or new_request_id()
    return response


async def drain_runs(state: ServerState, timeout: float) -> None:
    """Shutdown: let running responses finish for up to `timeout` seconds, then cancel the rest.
    Either way each run writes its final state to the store before this returns (uvicorn has
    already stopped accepting connections and given open ones their own grace period)."""
    tasks = [run.task for run in state.runs.runs.values() if run.task is not None and not run.task.done()]
    if tasks:
        log.info("shutting down: waiting up to %.1fs for %d running responses", timeout, len(tasks))
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        if pending:
            log.warning("shutting down: cancelling %d responses still running", len(pending))
    await state.runs.cancel_all()


class ReadinessGate:
    """Model endpoints answer 503 until the engine is loaded (health, ready, metrics do not wait)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        path = dialect.api_path(scope["path"]) if scope["type"] in ("http", "websocket") else ""
        if path.startswith("/v1/") and not self.state.ready and not path.startswith("/v1/models"):
            error = self.state.extra.get("load_error")
            message = (
                f"The model failed to load: {error}"
                if error
                else "The model is still loading; retry shortly (GET /ready answers 200 once it is loaded)."
            )
            refusal = APIError(message, status=503, code="model_not_ready", type="server_error")
            if scope["type"] == "websocket":
                return await refusal.refuse_websocket(scope, receive, send)
            return await refusal.response()(scope, receive, send)
        return await self.app(scope, receive, send)


async def open_store(config: ServerConfig) -> ResponseStore:
    """The SQLite file at config.store_path, or the PostgreSQL database at config.store_url."""
    if not config.store_url:
        return SQLiteResponseStore(config.store_path)
    from agent_server.store_postgres import PostgresStore

    try:
        return await PostgresStore.open(config.store_url)
    except Exception as e:
        log.error("could not open the store %s: %s: %s", redacted_url(config.store_url), type(e).__name__, e)
        raise


def redacted_url(url: str) -> str:
    """A database URL as it may be logged: without its password."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def create_app(
    config: ServerConfig,
    engine_factory: EngineFactory,
    *,
    tool_servers: ToolServersFactory | None = None,
    store: ResponseStore | Callable[[], Awaitable[ResponseStore]] | None = None,
    on_load_error: Callable[[str], None] | None = None,
) -> Starlette:
    """The ASGI app. `engine_factory` builds the engine (sync or async) at startup, a sync one
    on a worker thread (the event loop answers /health meanwhile); `tool_servers` starts the
    tool servers; `store` (or a coroutine function opening it at startup, on the server's event
    loop) defaults to `open_store(config)`. `on_load_error(message)`: the
    model or a tool server failed to start (the CLI exits); /health and /ready say so anyway."""
    state = ServerState(config=config, metrics=Metrics(lambda: state.engine))
    building: asyncio.Future | None = None  # a sync factory's build on a worker thread, once begun

    async def build_engine() -> EngineClient:
        nonlocal building
        if inspect.iscoroutinefunction(engine_factory):
            return await engine_factory()
        building = asyncio.ensure_future(asyncio.to_thread(engine_factory))
        engine = await asyncio.shield(building)  # (a thread cannot be cancelled: see the lifespan)
        return await engine if inspect.isawaitable(engine) else engine

    async def load() -> None:
        try:
            await asyncio.to_thread(warm_up)
            servers = await tool_servers() if tool_servers is not None else []
            state.tools = ToolRegistry(servers)
            engine = await build_engine()
            state.engine = engine
            state.extra["loaded_at"] = time.time()
            log.info(
                "ready: serving %s (context %d tokens); /ready answers 200 from now on",
                config.model_name,
                engine.max_model_len,
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported by /health and /ready
            if isinstance(e, ToolServerError):  # the configuration's fault, said in one line
                log.error("startup failed: %s", e)
            else:
                log.exception("startup failed")
            state.extra["load_error"] = f"{type(e).__name__}: {e}"
            if on_load_error is not None:
                on_load_error(state.extra["load_error"])

    @asynccontextmanager
    async def lifespan(app: Starlette):
        if store is None:
            state.store = await open_store(config)
        else:
            state.store = await store() if inspect.iscoroutinefunction(store) else store
        state.store.set_cancel_handler(state.runs.stop)
        state.store.set_live_runs(lambda response_id: state.runs.get(response_id) is not None)
        loading = asyncio.create_task(load())
        try:
            yield
        finally:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            if building is not None and state.engine is None:
                # Stopped while the model loaded: a thread cannot be cancelled, so the engine
                # it builds is shut down once it is there (an engine process would outlive us).
                log.info("waiting for the engine to finish loading, to shut it down")
                built = (await asyncio.gather(building, return_exceptions=True))[0]
                if not isinstance(built, BaseException) and not inspect.isawaitable(built):
                    state.engine = built
            await drain_runs(state, config.shutdown_timeout)
            for server in state.tools.servers:
                try:
                    await server.aclose()
                except Exception:
                    log.exception("closing tool server %s", getattr(server, "name", server))
            if state.engine is not None:
                await state.engine.shutdown()
            state.renderer.shutdown()
            await state.store.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        *responses_routes.routes,
        *responses_websocket.routes,
        # The Responses API again under /openresponses/v1, its stream as the Open Responses
        # specification names it (responses/dialect.py).
        dialect.mount([*responses_routes.routes, *responses_websocket.routes]),
        *conversations_routes.routes,
        *chat_routes.routes,
        *playground.routes,
    ]
    middleware = [
        Middleware(RequestIdMiddleware),
        Middleware(UnexpectedErrorMiddleware),
        Middleware(MetricsMiddleware, metrics=state.metrics),
    ]
    if config.cors_origins:  # outside the key check: preflight requests carry no credentials
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=config.cors_origins,
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["x-request-id"],
            )
        )
    middleware += [
        Middleware(CrossSiteGuard, allowed_hosts=config.allowed_hosts),
        Middleware(ApiKeyMiddleware, api_key=config.api_key, api_keys=config.api_keys),
        Middleware(ReadinessGate, state=state),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected},
    )
    app.state.server = state
    return app
