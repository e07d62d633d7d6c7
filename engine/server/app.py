"""The FastAPI app: routes, API-key and body-size guards, error handlers, and ``run_server``.

Routes (vLLM's): GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /health, GET /version, GET /metrics; POST /v1/audio/transcriptions and
/v1/audio/translations (multipart uploads, answered by a Whisper engine); POST /v1/load_lora_adapter and
/v1/unload_lora_adapter when runtime adapter updating is allowed.

One app serves one engine, or two: a chat model's and, with ``--transcription-model``, a Whisper model's
(``build_app(engine_client, args, transcription_client)``). The ``model`` field routes by served names:
/v1/audio/* need the Whisper model's (400 for the chat model's), chat and completions the chat model's
(400 for the Whisper model's); an unknown name is a 404. A server of a Whisper model alone answers
/v1/audio/* and refuses chat and completions with a 400. /v1/models lists both models, /health checks
both engines, /metrics reports both (``model_name`` label).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.async_llm import AsyncLLM
from engine.server import args as serve_args
from engine.server import metrics
from engine.server.errors import (BadRequestError, PayloadTooLargeError, ServiceUnavailableError,
                                  UnauthorizedError, error_body, install_error_handlers)
from engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeChatRequest, TokenizeCompletionRequest)
from engine.server.serving_chat import OpenAIServingChat
from engine.server.serving_completion import OpenAIServingCompletion
from engine.server.serving_models import OpenAIServingModels, parse_lora_modules
from engine.server.serving_tokenize import OpenAIServingTokenization
from engine.server.serving_transcription import OpenAIServingTranscription

logger = logging.getLogger("chorus.server")

CHORUS_VERSION = "0.1.0"


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    base_model_name: Optional[str] = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


# ----------------------------------------------------------------------------------------
# ASGI guards (pure ASGI so streaming responses pass through untouched)
# ----------------------------------------------------------------------------------------
async def _send_error(send: Send, status: int, body: dict) -> None:
    resp = JSONResponse(body, status_code=status)
    await resp({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - JSONResponse never reads
    return {"type": "http.disconnect"}


class APIKeyMiddleware:
    """401 on /v1/* without ``Authorization: Bearer <key>`` (other routes stay open, as vLLM)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope.get("method") != "OPTIONS"
                and scope.get("path", "").startswith("/v1")):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"")
            if not hmac.compare_digest(auth, b"Bearer " + self.api_key):
                err = UnauthorizedError("Unauthorized: missing or invalid API key.")
                await _send_error(send, 401, error_body(err.message, err.err_type, 401))
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for request bodies above ``max_bytes`` (by Content-Length, or counted when chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await self._refuse(send, scope.get("path", ""))
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): buffer up to the limit, then replay to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send, scope.get("path", ""))
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, path: str) -> None:
        err = PayloadTooLargeError(f"Request body is larger than the limit of {self.max_bytes} bytes.")
        if path.startswith("/v1/audio/"):
            err = PayloadTooLargeError(err.message + " Audio files may be at most 25 MB.", param="file")
        await _send_error(send, 413, error_body(err.message, err.err_type, 413, err.param))


# ----------------------------------------------------------------------------------------
# App
# ----------------------------------------------------------------------------------------
@dataclass
class ServingState:
    """Everything the routes use; also on ``app.state.serving`` for tests and extensions."""

    engine_client: AsyncLLM
    """The served MODEL's engine (chat and completions; a Whisper one when MODEL is Whisper)."""
    models: OpenAIServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    registry: Any
    """The app's prometheus CollectorRegistry."""
    transcription: Optional[OpenAIServingTranscription] = None
    """/v1/audio/*: MODEL's engine when it is Whisper, else the --transcription-model one; None: neither."""
    engine_clients: list[AsyncLLM] = field(default_factory=list)
    """Every engine served (MODEL's, then the Whisper one when it is a second engine): health, shutdown."""

    @property
    def serves_whisper_only(self) -> bool:
        """MODEL itself is a Whisper model (no chat model is served)."""
        return self.transcription is not None and self.transcription.engine_client is self.engine_client


def build_app(engine_client: AsyncLLM, args: Optional[argparse.Namespace] = None,
              transcription_client: Optional[AsyncLLM] = None) -> FastAPI:
    """Build the app around a running ``AsyncLLM`` (and the ``--transcription-model`` Whisper one, if
    any); the app shuts the engines down on exit."""
    args = args or serve_args.make_serve_namespace()
    check_engines(args, engine_client, transcription_client)
    engines = [engine_client] + ([transcription_client] if transcription_client is not None else [])
    for client in engines:
        client.processor.reject_overlong_max_tokens = True   # vLLM's server behaviour
        client.processor.allow_local_media_paths = False     # media: URLs and uploads only
    served_names = args.served_model_name or [engine_client.model_name]
    model_path = serve_args.resolve_model(args) or engine_client.model_name
    models = OpenAIServingModels(engine_client, served_names, model_path,
                                 parse_lora_modules(args.lora_modules))
    registry, stat_logger = metrics.make_registry(engine_client, models.model_name)
    engine_client.stat_loggers.append(stat_logger)
    transcription = None
    if transcription_client is not None:
        whisper_root = (serve_args.whisper_path(args.transcription_model) if args.transcription_model
                        else transcription_client.model_name)
        whisper_models = OpenAIServingModels(
            transcription_client, args.transcription_served_model_name or [transcription_client.model_name],
            whisper_root)
        whisper_registry, whisper_stat_logger = metrics.make_registry(transcription_client,
                                                                      whisper_models.model_name)
        transcription_client.stat_loggers.append(whisper_stat_logger)
        registry = _MergedRegistry([registry, whisper_registry])
        transcription = OpenAIServingTranscription(transcription_client, whisper_models, chat_models=models)
    elif engine_client.processor.transcriber is not None:
        transcription = OpenAIServingTranscription(engine_client, models)
    st = ServingState(engine_client, models, OpenAIServingCompletion(engine_client, models),
                      OpenAIServingChat(engine_client, models),
                      OpenAIServingTokenization(engine_client, models), registry, transcription, engines)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await models.init_static_loras()
        try:
            yield
        finally:
            for client in engines:
                client.shutdown()

    app = FastAPI(title="Chorus", version=CHORUS_VERSION, lifespan=lifespan)
    app.state.serving = st
    app.state.engine_client = engine_client
    install_error_handlers(app)
    _add_utility_routes(app, st)
    _add_generation_routes(app, st)
    _add_audio_routes(app, st)
    if serve_args.runtime_lora_updating(args):
        _add_lora_routes(app, st)
    # The middleware added last runs first: size limit, then API key, then CORS.
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_credentials=True,
                       allow_methods=["*"], allow_headers=["*"])
    key = serve_args.api_key(args)
    if key:
        app.add_middleware(APIKeyMiddleware, api_key=key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_bytes)
    return app


def check_engines(args: argparse.Namespace, engine_client: AsyncLLM,
                  transcription_client: Optional[AsyncLLM]) -> None:
    """ValueError when the engines do not fit ``--task`` / ``--transcription-model``."""
    task = getattr(args, "task", "auto")
    is_whisper = engine_client.processor.transcriber is not None
    if task == "transcription" and not is_whisper:
        raise ValueError(f"--task transcription: {engine_client.model_name} is not a Whisper model; serve a "
                         "Whisper directory, or drop --task to serve it as a chat model.")
    if task == "generate" and is_whisper:
        raise ValueError(f"--task generate: {engine_client.model_name} is a Whisper model, it only "
                         "transcribes; use --task transcription (or auto).")
    if transcription_client is None:
        return
    if is_whisper:
        raise ValueError(f"{engine_client.model_name} is already a Whisper model; drop --transcription-model "
                         "(or serve a chat MODEL next to it).")
    if transcription_client.processor.transcriber is None:
        raise ValueError(f"--transcription-model {transcription_client.model_name} is not a Whisper model.")


class _MergedRegistry:
    """Several apps' registries rendered as one exposition: samples of the same metric (one per engine,
    told apart by their ``model_name`` label) under one family, as Prometheus requires."""

    def __init__(self, registries: list[Any]) -> None:
        self.registries = registries

    def collect(self) -> Iterable[Any]:
        families: dict[str, Any] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return list(families.values())


def _add_utility_routes(app: FastAPI, st: ServingState) -> None:
    @app.get("/health")
    async def health() -> Response:
        for client in st.engine_clients:
            try:
                client.check_health()
            except Exception as e:  # noqa: BLE001
                return JSONResponse(error_body(f"The engine of {client.model_name} is not healthy: {e}",
                                               "ServiceUnavailableError", 503), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": CHORUS_VERSION}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(st.registry), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = st.models.show_available_models()
        if st.transcription is not None and not st.serves_whisper_only:
            cards.data += st.transcription.models.show_available_models().data
        return JSONResponse(cards.model_dump(mode="json"))

    @app.post("/tokenize")
    async def tokenize(request: Union[TokenizeChatRequest, TokenizeCompletionRequest]) -> JSONResponse:
        return JSONResponse(st.tokenization.tokenize(request).model_dump(mode="json"))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(st.tokenization.detokenize(request).model_dump(mode="json"))


def _check_engine(client: AsyncLLM) -> None:
    if client.errored:
        raise ServiceUnavailableError(f"The engine is not available: {client.dead_error}")


def _add_generation_routes(app: FastAPI, st: ServingState) -> None:
    def check_generates(model: Optional[str]) -> None:
        """400 for the Whisper model's name (or any name, when only a Whisper model is served)."""
        if st.serves_whisper_only:
            st.models.resolve_model_name(model)   # 404 for names nobody serves
        elif st.transcription is None or not st.transcription.serves(model):
            _check_engine(st.engine_client)
            return
        name = model or st.models.model_name
        raise BadRequestError(f"The model `{name}` is a Whisper model: it only transcribes audio (POST "
                              "/v1/audio/transcriptions or /v1/audio/translations with a file); chat and "
                              "completions requests cannot run on it.", param="model")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        check_generates(request.model)
        return await st.completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        check_generates(request.model)
        return await st.chat.create_chat_completion(request, raw_request)


def _add_audio_routes(app: FastAPI, st: ServingState) -> None:
    """OpenAI's audio routes; without a Whisper model they answer 400 saying how to serve one."""

    def serving() -> OpenAIServingTranscription:
        if st.transcription is None:
            raise BadRequestError(f"This server serves no Whisper model ({st.models.model_name} is a chat "
                                  "model), so it cannot transcribe audio; start it with `chorus serve MODEL "
                                  "--transcription-model default` (Whisper tiny.en next to MODEL) or `chorus "
                                  "serve --task transcription` (Whisper alone).", param="model")
        _check_engine(st.transcription.engine_client)
        return st.transcription

    @app.post("/v1/audio/transcriptions")
    async def create_transcription(raw_request: Request) -> Response:
        return await serving().create_transcription("transcribe", raw_request)

    @app.post("/v1/audio/translations")
    async def create_translation(raw_request: Request) -> Response:
        return await serving().create_transcription("translate", raw_request)


def _add_lora_routes(app: FastAPI, st: ServingState) -> None:
    """vLLM's runtime adapter routes (mounted only with --allow-runtime-lora-updating)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        await st.models.load_lora_adapter(request.lora_name, request.lora_path, request.base_model_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        await st.models.unload_lora_adapter(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


def run_server(args: argparse.Namespace) -> None:
    """``chorus serve``: load the engine, serve until SIGTERM/SIGINT, then shut down cleanly.

    On a signal uvicorn stops accepting connections; in-flight requests get ``--shutdown-timeout``
    seconds to finish, then the engine stops and the ones left end with a 503 error (streams: an
    in-band error event and ``[DONE]``); the port is released and the process exits with 0. An engine
    that dies by itself (a fatal step fault) stops the server the same way, then raises SystemExit
    (status 1).
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    serve_args.check_task_args(args)
    engines: list[AsyncLLM] = []

    def load(kwargs: dict[str, Any], engine_process: bool) -> AsyncLLM:
        logger.info("Loading model %s ...", kwargs["model"] or "(default SmolLM2)")
        engines.append(AsyncLLM.from_engine_args(log_requests=not args.disable_log_requests,
                                                 engine_process=engine_process, **kwargs))
        return engines[-1]

    try:
        # NOTE: the Whisper engine loads first: on CUDA MODEL's KV cache then takes what is left of
        # --gpu-memory-utilization (the budget counts memory already in use on the device).
        model_process, whisper_process = serve_args.engine_processes(args)
        whisper_kwargs = serve_args.transcription_engine_kwargs(args)
        transcription_client = load(whisper_kwargs, whisper_process) if whisper_kwargs is not None else None
        engine_client = load(serve_args.engine_kwargs(args), model_process)
        app = build_app(engine_client, args, transcription_client)
    except BaseException:
        for client in engines:
            client.shutdown()
        raise
    host = args.host or "0.0.0.0"
    config = uvicorn.Config(app, host=host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, lifespan="on")
    logger.info("Serving %s on http://%s:%d", " and ".join(c.model_name for c in engines), host, args.port)
    server = _GracefulServer(config, engines, args.shutdown_timeout)
    try:
        server.run()
    finally:
        for client in engines:
            client.shutdown()
    if server.engine_error is not None:   # README, "Failure behaviour": a supervisor restarts us
        raise SystemExit(f"The engine died ({server.engine_error}); exiting with status 1 so that a "
                         "supervisor restarts the server.")
    logger.info("Chorus server stopped.")


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server that, after the grace period, ends leftover requests through the engine and
    does not re-raise the signal it caught (so a SIGTERM'd server exits with 0)."""

    def __init__(self, config: uvicorn.Config, engine_clients: list[AsyncLLM], grace_s: float) -> None:
        super().__init__(config)
        self.engine_clients = engine_clients
        self.grace_s = grace_s
        self.engine_error: Optional[BaseException] = None
        """Why an engine died by itself (a fatal step fault, a killed engine process): the server
        then stops as on a signal, and ``run_server`` exits non-zero."""

    async def on_tick(self, counter: int) -> bool:
        if self.engine_error is None and not self.should_exit:
            dead = next((c for c in self.engine_clients if c.errored), None)
            if dead is not None:
                self.engine_error = dead.dead_error
                logger.error("The engine of %s died: %s; stopping the server.", dead.model_name, dead.dead_error)
                return True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: Any) -> None:
        logger.info("Signal %d received: shutting down (grace period %.1f s).", sig, self.grace_s)
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()

    async def shutdown(self, sockets: Any = None) -> None:
        async def end_leftovers() -> None:
            await asyncio.sleep(self.grace_s)
            for client in self.engine_clients:
                client.shutdown()  # streams end with an in-band error, the rest with 503

        task = asyncio.ensure_future(end_leftovers())
        try:
            await super().shutdown(sockets)
        finally:
            task.cancel()
