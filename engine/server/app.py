"""The FastAPI app: routes, error handlers, the guards of ``guards.py``, and ``run_server`` (start-up
checks, the port bound before the model loads, one-line start-up errors).

Routes (vLLM's): GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/messages
(Anthropic's Messages API over the chat route: ``engine/server/anthropic``), POST /tokenize, POST
/detokenize, GET /health, GET and POST /ping (as /health), GET /version, GET /metrics; POST
/v1/audio/transcriptions and /v1/audio/translations (multipart uploads, answered by a Whisper engine);
POST /v1/load_lora_adapter and /v1/unload_lora_adapter when runtime adapter updating is allowed. Errors
are OpenAI's shape, on /v1/messages Anthropic's.

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
import builtins
import errno
import json
import logging
import re
import socket
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from engine.async_llm import AsyncLLM
from engine.errors import EngineStartupError
from engine.reasoning.registry import get_reasoning_parser
from engine.server import args as serve_args
from engine.server import metrics
from engine.server.anthropic.errors import from_openai_error
from engine.server.anthropic.serving import AnthropicMessages
from engine.server.errors import (BadRequestError, OpenAIError, ServiceUnavailableError, error_body,
                                  install_error_handlers)
from engine.server.guards import (ANTHROPIC_ROUTES, APIKeyMiddleware, ClientGuardMiddleware,
                                  RequestIdHeaderMiddleware, head_deadline_protocol)
from engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeChatRequest, TokenizeCompletionRequest)
from engine.server.serving_chat import OpenAIServingChat
from engine.server.serving_completion import OpenAIServingCompletion
from engine.server.lora_paths import resolve_allowed_roots
from engine.server.lora_resolver import filesystem_resolvers
from engine.server.serving_models import OpenAIServingModels, parse_lora_modules
from engine.server.serving_tokenize import OpenAIServingTokenization
from engine.server.serving_transcription import OpenAIServingTranscription
from engine.tool_calls.registry import get_tool_parser
from lora import errors as lora_errors

logger = logging.getLogger("chorus.server")

CHORUS_VERSION = "0.1.0"


class LoadLoRAAdapterRequest(BaseModel):
    """Body of POST /v1/load_lora_adapter (vLLM's)."""

    lora_name: str
    """The name requests pass as ``model``."""
    lora_path: str
    """The adapter's PEFT directory on the server; with --allowed-lora-path, under one of its directories."""
    base_model_name: Optional[str] = None
    """Shown as the adapter's ``parent`` in /v1/models (default: the served model)."""


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


# ----------------------------------------------------------------------------------------
# App
# ----------------------------------------------------------------------------------------
@dataclass
class ServingState:
    """Everything the routes use, built once (``serving_state``) before the app; also on
    ``app.state.serving`` for tests and extensions."""

    engine_client: AsyncLLM
    """The served MODEL's engine (chat and completions; a Whisper one when MODEL is Whisper)."""
    models: OpenAIServingModels
    """MODEL's served names and adapters (/v1/models, adapter loading)."""
    completion: OpenAIServingCompletion
    """/v1/completions."""
    chat: OpenAIServingChat
    """/v1/chat/completions."""
    tokenization: OpenAIServingTokenization
    """/tokenize and /detokenize."""
    registry: Any
    """The app's prometheus CollectorRegistry."""
    transcription: Optional[OpenAIServingTranscription]
    """/v1/audio/*: MODEL's engine when it is Whisper, else the --transcription-model one; None: neither."""
    engine_clients: list[AsyncLLM]
    """Every engine served (MODEL's, then the Whisper one when it is a second engine): health, shutdown."""
    static_adapters_loaded: bool = False
    """The --lora-modules adapters are in the engine (``load_static_adapters`` ran)."""

    @property
    def serves_whisper_only(self) -> bool:
        """MODEL itself is a Whisper model (no chat model is served)."""
        return self.transcription is not None and self.transcription.engine_client is self.engine_client


def build_app(engine_client: AsyncLLM, args: Optional[argparse.Namespace] = None,
              transcription_client: Optional[AsyncLLM] = None) -> FastAPI:
    """Build the app around a running ``AsyncLLM`` (and the ``--transcription-model`` Whisper one, if
    any); the app shuts the engines down on exit."""
    args = args or serve_args.make_serve_namespace()
    st = serving_state(engine_client, args, transcription_client)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await load_static_adapters(st)   # run_server loads them before it serves; others (tests) here
        try:
            yield
        finally:
            for client in st.engine_clients:
                client.shutdown()

    app = FastAPI(title="Chorus", version=CHORUS_VERSION, lifespan=lifespan)
    app.state.serving = st
    install_error_handlers(app)
    _anthropic_error_shape(app, ANTHROPIC_ROUTES)
    _add_utility_routes(app, st)
    _add_generation_routes(app, st)
    _add_audio_routes(app, st)
    if serve_args.runtime_lora_updating(args):
        _add_lora_routes(app, st, getattr(args, "allowed_lora_path", None))
    # The middleware added last runs first: body size and slow clients, then API key, then the
    # X-Request-Id header, then CORS. Credentials only ever go to an explicit list of origins.
    serve_args.check_cors_args(args)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                       allow_credentials=getattr(args, "allow_credentials", False),
                       allow_methods=getattr(args, "allowed_methods", ["*"]),
                       allow_headers=getattr(args, "allowed_headers", ["*"]))
    app.add_middleware(RequestIdHeaderMiddleware)
    key = serve_args.api_key(args)
    if key:
        app.add_middleware(APIKeyMiddleware, api_key=key)
    app.add_middleware(ClientGuardMiddleware, max_body_bytes=args.max_request_body_bytes,
                       timeout_s=args.slow_client_timeout)
    return app


def serving_state(engine_client: AsyncLLM, args: argparse.Namespace,
                  transcription_client: Optional[AsyncLLM] = None) -> ServingState:
    """The route handlers around the engines (built with the server's request checks and limits:
    ``usage_context="server"``, ``request_limits``) and their metrics, in one ``ServingState``. ValueError
    when the engines do not fit the flags (``check_engines``)."""
    check_engines(args, engine_client, transcription_client)
    serve_args.check_tool_args(args)
    engines = [engine_client] + ([transcription_client] if transcription_client is not None else [])
    served_names = args.served_model_name or [engine_client.model_name]
    model_path = serve_args.resolve_model(args) or engine_client.model_name
    models = OpenAIServingModels(engine_client, served_names, model_path,
                                 parse_lora_modules(args.lora_modules),
                                 lora_resolvers=filesystem_resolvers(getattr(args, "lora_dir", None)))
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
    tool_parser_name = getattr(args, "tool_call_parser", None)
    reasoning_parser_name = getattr(args, "reasoning_parser", None)
    chat = OpenAIServingChat(
        engine_client, models, args.trust_request_chat_template,
        tool_parser=get_tool_parser(tool_parser_name) if tool_parser_name else None,
        enable_auto_tools=bool(getattr(args, "enable_auto_tool_choice", False)),
        reasoning_parser=get_reasoning_parser(reasoning_parser_name) if reasoning_parser_name else None,
        reasoning_before_constraint=engine_client.engine_config.structured_outputs_config.reasoning_parser
        is not None)
    return ServingState(engine_client, models, OpenAIServingCompletion(engine_client, models), chat,
                        OpenAIServingTokenization(engine_client, models, args.trust_request_chat_template),
                        registry, transcription, engines)


async def load_static_adapters(st: ServingState) -> None:
    """Load the --lora-modules adapters into the engine, once; ValueError naming the item and why."""
    if st.static_adapters_loaded:
        return
    for module in st.models.static_lora_modules:
        try:
            await st.models.load_lora_adapter(module.name, module.path, module.base_model_name)
        except (ValueError, OpenAIError) as e:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e}") from e
    st.static_adapters_loaded = True


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

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """vLLM's (SageMaker's) health check: answers as /health."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": CHORUS_VERSION}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(st.registry), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(all: bool = False) -> JSONResponse:
        """``?all=true`` also lists the adapters ``--lora-dir`` would load by name (none is loaded)."""
        resolvable = await st.models.list_resolvable() if all else ()
        cards = st.models.show_available_models(resolvable)
        if st.transcription is not None and not st.serves_whisper_only:
            cards.data += st.transcription.models.show_available_models().data
        return JSONResponse(cards.model_dump(mode="json"))

    @app.post("/tokenize")
    async def tokenize(request: Union[TokenizeChatRequest, TokenizeCompletionRequest]) -> JSONResponse:
        await st.models.resolve_lora_by_name(request.model)
        return JSONResponse((await st.tokenization.tokenize(request)).model_dump(mode="json"))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        await st.models.resolve_lora_by_name(request.model)
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
        await st.models.resolve_lora_by_name(request.model)   # --lora-dir: load DIR/NAME on first use
        return await st.completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        check_generates(request.model)
        await st.models.resolve_lora_by_name(request.model)
        return await st.chat.create_chat_completion(request, raw_request)

    async def chat_backend(body: dict[str, Any], raw_request: Request) -> Response:
        request = ChatCompletionRequest.model_validate(body)
        check_generates(request.model)
        await st.models.resolve_lora_by_name(request.model)
        return await st.chat.create_chat_completion(request, raw_request)

    messages = AnthropicMessages(chat_backend)

    @app.post("/v1/messages")
    async def create_message(raw_request: Request) -> Response:
        """Anthropic's Messages API: the request is translated to a chat completion (the same model and
        adapter selection) and its reply, stream or error back to Anthropic's shapes."""
        return await messages.create_message(raw_request)


def _anthropic_error_shape(app: FastAPI, paths: Iterable[str]) -> None:
    """The app's error handlers answer in Anthropic's shape on ``paths`` (a 405, a 404 of the route, ...;
    the /v1/messages handler shapes its own errors)."""
    anthropic_paths = frozenset(paths)

    def wrap(handler: Callable[[Request, Exception], Awaitable[Response]]
             ) -> Callable[[Request, Exception], Awaitable[Response]]:
        async def shaped(request: Request, exc: Exception) -> Response:
            response = await handler(request, exc)
            if request.url.path not in anthropic_paths or response.status_code < 400:
                return response
            try:
                body = json.loads(bytes(response.body))
            except ValueError:
                body = None
            retry_after = response.headers.get("retry-after")
            return from_openai_error(body, response.status_code,
                                     {"Retry-After": retry_after} if retry_after else None)
        return shaped

    for key, handler in list(app.exception_handlers.items()):
        app.exception_handlers[key] = wrap(handler)


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


def _add_lora_routes(app: FastAPI, st: ServingState, allowed_lora_path: Optional[list[str]] = None) -> None:
    """vLLM's runtime adapter routes (mounted only with --allow-runtime-lora-updating). A client's
    ``lora_path`` must lie under one of the ``allowed_lora_path`` directories (--allowed-lora-path)
    when they are given; any readable directory otherwise (vLLM's behaviour)."""
    roots = resolve_allowed_roots(allowed_lora_path) if allowed_lora_path is not None else None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        await st.models.load_runtime_lora_adapter(request.lora_name, request.lora_path, request.base_model_name,
                                                  allowed_roots=roots)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        await st.models.unload_lora_adapter(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


EXIT_CONFIG_ERROR = 2
"""``chorus serve``'s exit status when a flag, a path, a file or the port cannot work (argparse's own for
usage errors): one line on stderr, ``chorus serve: error: ...``, naming the flag and the fix."""
EXIT_STARTUP_FAILURE = 1
"""... when anything else stops it before it serves (a bug, out of memory): one line too (``--debug``
prints the traceback)."""


class StartupError(Exception):
    """``chorus serve`` stopped before it served. ``str()`` is one line that names the flag and the fix;
    ``exit_code`` is ``EXIT_CONFIG_ERROR`` or ``EXIT_STARTUP_FAILURE``; the error itself is ``__cause__``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


_CONFIG_ERRORS = (ValueError, OSError, ImportError)
"""What a setting, a file or the environment causes (a LoRA adapter error is a ValueError)."""


def startup_error(exc: BaseException) -> StartupError:
    """Any error raised before the server serves -> its one-line ``StartupError``."""
    if isinstance(exc, StartupError):
        return exc
    kind, message, config = type(exc).__name__, " ".join(str(exc).split()), isinstance(exc, _CONFIG_ERRORS)
    if isinstance(exc, EngineStartupError):   # the engine process: "...: Type: message\ntraceback"
        m = re.match(r"The engine failed to start: (\w+): (.*)", str(exc).split("\n", 1)[0])
        if m is not None:
            kind, message = m.group(1), m.group(2).strip()
            known = getattr(builtins, kind, None) or getattr(lora_errors, kind, None)
            config = isinstance(known, type) and issubclass(known, _CONFIG_ERRORS)
        else:
            message = str(exc).split("\n", 1)[0]
    if config:
        return StartupError(serve_args.name_the_flag(message or kind), EXIT_CONFIG_ERROR)
    return StartupError(f"{kind}: {message} (start-up failed; --debug prints the traceback)",
                        EXIT_STARTUP_FAILURE)


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before any model loads (a port in use stops start-up at once, and no
    other process can take the port while the model loads); uvicorn listens on it once serving.

    Raises:
        ValueError: naming --port or --host and the fix.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: a restart rebinds at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use; stop the server that holds it "
                             "or choose another --port.") from e
        if e.errno == errno.EACCES:
            raise ValueError(f"--port {port}: permission denied; choose a port above 1023 (or run with the "
                             "privilege to bind low ports).") from e
        raise ValueError(f"--host {host}: cannot listen there ({e.strerror or e}); give an address of this "
                         "machine, e.g. 0.0.0.0 (all interfaces) or 127.0.0.1.") from e
    return sock


def uvicorn_config(app: FastAPI, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings from the serve flags; the caller passes the socket (``bind_socket``). Idle
    keep-alive connections close after uvicorn's 5 s, request heads have ``--slow-client-timeout``."""
    return uvicorn.Config(app, log_level=args.uvicorn_log_level,
                          access_log=not args.disable_uvicorn_access_log,
                          timeout_graceful_shutdown=args.shutdown_timeout + 5, lifespan="on",
                          http=head_deadline_protocol(args.slow_client_timeout))


def run_server(args: argparse.Namespace) -> None:
    """``chorus serve``: check the flags, bind the port, load the engine and the --lora-modules adapters,
    log "Serving ... on http://...", serve until SIGTERM/SIGINT, then shut down cleanly.

    Raises:
        StartupError: anything failed before the "Serving" line (nothing was served).

    On a signal uvicorn stops accepting connections; in-flight requests get ``--shutdown-timeout``
    seconds to finish, then the engine stops and the ones left end with a 503 error (streams: an
    in-band error event and ``[DONE]``); the port is released and the process exits with 0. An engine
    that dies by itself (a fatal step fault) stops the server the same way, then raises SystemExit
    (status 1).
    """
    # NOTE: logs go to stdout (as vLLM's), so stderr carries only errors: a failed start-up is one line.
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    engines: list[AsyncLLM] = []
    sock: Optional[socket.socket] = None
    try:
        serve_args.check_serve_args(args)
        host = args.host or "0.0.0.0"
        sock = bind_socket(host, args.port)
        app = _load_engines(args, engines)
    except Exception as e:
        _close(engines, sock)
        raise startup_error(e) from e
    except BaseException:   # Ctrl-C while loading
        _close(engines, sock)
        raise

    async def before_serving() -> None:
        await load_static_adapters(app.state.serving)
        port = sock.getsockname()[1]
        logger.info("Serving %s on http://%s:%d", " and ".join(c.model_name for c in engines), host, port)

    server = _GracefulServer(uvicorn_config(app, args), engines, args.shutdown_timeout, before_serving)
    try:
        server.run(sockets=[sock])
    except Exception as e:
        if server.serving:
            raise
        raise startup_error(e) from e
    finally:
        _close(engines, sock)
    if server.engine_error is not None:   # README, "Failure behaviour": a supervisor restarts us
        raise SystemExit(f"The engine died ({server.engine_error}); exiting with status 1 so that a "
                         "supervisor restarts the server.")
    logger.info("Chorus server stopped.")


def _load_engines(args: argparse.Namespace, engines: list[AsyncLLM]) -> FastAPI:
    """Load MODEL's engine (and the --transcription-model one) into ``engines``; the app around them."""

    def load(kwargs: dict[str, Any], engine_process: bool) -> AsyncLLM:
        logger.info("Loading model %s ...", kwargs["model"] or "(default SmolLM2)")
        engines.append(AsyncLLM.from_engine_args(log_requests=not args.disable_log_requests,
                                                 engine_process=engine_process,
                                                 limits=serve_args.request_limits(args), **kwargs))
        return engines[-1]

    # NOTE: the Whisper engine loads first: on CUDA MODEL's KV cache then takes what is left of
    # --gpu-memory-utilization (the budget counts memory already in use on the device).
    model_process, whisper_process = serve_args.engine_processes(args)
    whisper_kwargs = serve_args.transcription_engine_kwargs(args)
    transcription_client = load(whisper_kwargs, whisper_process) if whisper_kwargs is not None else None
    engine_client = load(serve_args.engine_kwargs(args), model_process)
    return build_app(engine_client, args, transcription_client)


def _close(engines: list[AsyncLLM], sock: Optional[socket.socket]) -> None:
    for client in engines:
        client.shutdown()
    if sock is not None:
        sock.close()


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server that, after the grace period, ends leftover requests through the engine and
    does not re-raise the signal it caught (so a SIGTERM'd server exits with 0)."""

    def __init__(self, config: uvicorn.Config, engine_clients: list[AsyncLLM], grace_s: float,
                 before_serving: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self.engine_clients = engine_clients
        self.grace_s = grace_s
        self.before_serving = before_serving
        """Runs on the server's event loop before it serves (adapters, the "Serving" line); what it
        raises stops start-up."""
        self.serving = False
        """``before_serving`` passed: errors from here on are not start-up errors."""
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

    async def serve(self, sockets: Any = None) -> None:
        await self.before_serving()
        self.serving = True
        await super().serve(sockets)

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
