"""POST /v1/audio/transcriptions and /v1/audio/translations: an uploaded recording -> a Whisper engine's
transcript in one of OpenAI's response formats, or OpenAI's transcription SSE events.

One request's path (``LLM.transcribe`` is its offline twin):

    multipart form -> ``TranscriptionRequest`` and the upload's bytes     400 bad fields, 413 above 25 MB
    ``model`` -> the Whisper model or one of its adapters                 404 unknown, 400 the chat model
    options -> ``Transcriber.check_options``                              400 format, language, ...
    bytes -> ``load_audio`` in a worker thread, ``check_audio``           400 no audio, corrupt, too long,
                                                                              unsupported, silent
    multilingual model without ``language``: one 1-token detection request
    one engine request per 30 s window, all submitted together (they share the engine's steps; their
        features are computed in the engine client's media threads), outputs assembled and rendered
    ``timestamp_granularities[]=word`` (verbose_json only): once every window finished, one alignment call
        per window with text (``core_messages.AlignmentScores``), giving verbose_json's ``words``

Streaming (``stream=true``; json and text only): ``transcript.text.delta`` events in audio order (the
earliest unfinished window's tokens as they arrive; a later window's text once every earlier one has
finished), then ``transcript.text.done`` with the whole text and the duration usage, then ``data: [DONE]``
as the other stream routes end (OpenAI's SDK stops there). The deltas concatenate to the done text.

Errors before the first byte are HTTP errors; later ones an in-band error event. A client that goes away
or an error aborts every request of the transcription: nothing is left in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.datastructures import UploadFile

from engine.async_llm import AsyncLLM
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.server.errors import BadRequestError, PayloadTooLargeError, error_body, to_openai_error
from engine.server.protocol import SSE_DONE, TranscriptionRequest, random_id, sse_event
from engine.server.serving_base import ServingBase, merge_streams, run_unless_disconnected
from engine.server.serving_models import OpenAIServingModels
from engine.server.transcription_formats import (RESPONSE_FORMATS, duration_usage, render,
                                                 transcript_text_delta, transcript_text_done)
from engine.transcription import (Transcriber, TranscriptionOptions, TranscriptionResult, WindowPlan,
                                  options_from_form)
from lora.request import LoRARequest
from multimodal.audio import AudioError, DecodedAudio, load_audio

logger = logging.getLogger("chorus.server")

STREAM_FORMATS = ("json", "text")
"""The response formats ``stream=true`` accepts (the others need every segment first)."""
GRANULARITY_FIELDS = ("timestamp_granularities[]", "timestamp_granularities")
"""The form field OpenAI's SDKs send, and the spelling without brackets some clients use."""
MAX_FORM_FIELDS = 64


@dataclass
class AudioJob:
    """One checked request, before its audio is decoded."""

    request_id: str
    """Engine request ids are ``{request_id}-{window}`` and ``{request_id}-lang``."""
    form: TranscriptionRequest
    options: TranscriptionOptions
    language: Optional[str]
    """The language code the request fixes; None: detected from the first window."""
    lora: Optional[LoRARequest]


@dataclass
class WindowOutput:
    """One window's engine request and its output so far (DELTA outputs appended)."""

    plan: WindowPlan
    output: Optional[RequestOutput] = None
    """Everything the window generated so far: text, token ids, logprobs, prompt logprobs."""
    sent_text: str = ""
    """Streaming: the part of this window's text already sent in deltas."""

    @property
    def finished(self) -> bool:
        return self.output is not None and self.output.finished

    def add(self, out: RequestOutput) -> None:
        if self.output is None:
            self.output = out
            return
        acc, new = self.output.outputs[0], out.outputs[0]
        acc.text += new.text
        acc.token_ids = list(acc.token_ids) + list(new.token_ids)
        if new.logprobs:
            acc.logprobs = list(acc.logprobs or []) + list(new.logprobs)
        acc.finish_reason, acc.stop_reason = new.finish_reason, new.stop_reason
        if self.output.prompt_logprobs is None:
            self.output.prompt_logprobs = out.prompt_logprobs
        self.output.finished = out.finished

    def take_new_text(self, transcriber: Transcriber) -> str:
        """The window's text not sent yet: all of it once finished; before that, up to a possibly
        incomplete UTF-8 character at the end (decoded as U+FFFD until its last byte arrives)."""
        if self.output is None:
            return ""
        text = transcriber.window_text(self.output)
        if not self.finished:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent_text):
            # NOTE: byte-level BPE decoding without space clean-up only ever extends a prefix; should a
            # tokenizer rewrite sent text, the rest of the window is dropped here (the done event is exact).
            logger.warning("Window text changed after it was streamed; the deltas miss part of it.")
            return ""
        new, self.sent_text = text[len(self.sent_text):], text
        return new


@dataclass
class TranscriptDeltas:
    """Turns the transcript's pieces, in order, into deltas that concatenate to the stripped transcript
    (``join_texts``): whitespace at its start is dropped, whitespace at the end of what has arrived is
    held back until text follows it."""

    started: bool = False
    held: str = ""

    def push(self, piece: str) -> str:
        text = self.held + piece
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.held = text[len(body):]
        self.started = self.started or bool(body)
        return body


@dataclass
class RunningTranscription:
    """A decoded recording whose window requests are in the engine."""

    job: AudioJob
    audio: DecodedAudio
    language: Optional[str]
    """Given or detected."""
    windows: list[WindowOutput]
    streams: list[RequestStream] = field(default_factory=list)

    def abort(self) -> None:
        """Abort every window request not finished yet (idempotent)."""
        for stream in self.streams:
            stream.abort()

    async def abort_async(self) -> None:   # a response's BackgroundTask runs async callables on the loop
        self.abort()

    def result(self, transcriber: Transcriber, alignments: Optional[list] = None) -> TranscriptionResult:
        return transcriber.assemble(self.audio, [w.plan for w in self.windows],
                                    [w.output for w in self.windows], self.job.options, self.language,
                                    alignments)


class OpenAIServingTranscription(ServingBase):
    """The audio routes of one Whisper engine.

    Args:
        engine_client: the Whisper engine (its processor has a ``transcriber``).
        models: its served names and adapters (the ``model`` field).
        chat_models: the other engine's, when the server also serves a chat model (a request naming it
            is told to use the Whisper model).
    """

    def __init__(self, engine_client: AsyncLLM, models: OpenAIServingModels,
                 chat_models: Optional[OpenAIServingModels] = None) -> None:
        super().__init__(engine_client, models)
        transcriber = engine_client.processor.transcriber
        if transcriber is None:
            raise ValueError(f"{engine_client.model_name} is not a Whisper model; it cannot serve "
                             "/v1/audio/*.")
        self.transcriber: Transcriber = transcriber
        self.chat_models = chat_models

    def serves(self, name: Optional[str]) -> bool:
        """Whether ``model`` = ``name`` (not None) names this Whisper model or one of its adapters."""
        return name is not None and (self.models.is_base_model(name) or name in self.models.lora_requests)

    async def create_transcription(self, task: str, raw_request: Request) -> Response:
        """``task``: "transcribe" (/v1/audio/transcriptions) or "translate" (/v1/audio/translations)."""
        form, upload = await read_audio_form(raw_request)
        try:
            job = self._check(task, form, raw_request)
            data = await self._read_upload(upload)
        finally:
            await upload.close()
        if form.stream:
            run = await self._guard_disconnect(raw_request, self._start(job, data))
            if run is None:
                return Response(status_code=499)
            # NOTE: the background task also runs when the client leaves before the first event (the
            # generator's own ``finally`` then never runs).
            return StreamingResponse(self._events(run), media_type="text/event-stream",
                                     background=BackgroundTask(run.abort_async))
        result = await self._guard_disconnect(raw_request, self._transcribe(job, data))
        if result is None:
            return Response(status_code=499)
        body, media_type = render(form.response_format, text=result.text, segments=result.segments,
                                  language=result.language, duration_s=result.duration_s, task=result.task)
        if job.options.word_timestamps and isinstance(body, dict):
            body["words"] = [{"word": w.word.strip(), "start": w.start_s, "end": w.end_s} for w in result.words]
        if isinstance(body, dict):
            return JSONResponse(body)
        return Response(body, media_type=media_type)

    # ------------------------------------------------------------------------------------
    # Checks (nothing reaches the engine before they pass)
    # ------------------------------------------------------------------------------------
    def _check(self, task: str, form: TranscriptionRequest, raw_request: Request) -> AudioJob:
        lora = self._resolve_model(form.model)
        if form.response_format not in RESPONSE_FORMATS:
            raise BadRequestError(f"response_format: {form.response_format!r} is not supported; use one of "
                                  f"{', '.join(RESPONSE_FORMATS)}.", param="response_format")
        if form.stream and form.response_format not in STREAM_FORMATS:
            raise BadRequestError(f"stream: streaming sends text only; use response_format json or text, not "
                                  f"{form.response_format}.", param="stream")
        try:
            options = options_from_form(task, form.language, form.prompt, form.response_format,
                                        form.temperature, form.timestamp_granularities)
        except ValueError as e:
            raise BadRequestError(str(e), param="timestamp_granularities[]") from e
        if options.word_timestamps and self.engine_client.engine_config.lora_config is not None:
            raise BadRequestError("timestamp_granularities[]=word: word timestamps are not available on a server "
                                  "started with --enable-lora (the alignment pass runs the base weights).",
                                  param="timestamp_granularities[]")
        try:
            language = self.transcriber.check_options(options)
        except ValueError as e:
            raise BadRequestError(str(e), param=_param_of(str(e))) from e
        request_id = (raw_request.headers.get("X-Request-Id")
                      or random_id("trsc" if task == "transcribe" else "trsl"))
        return AudioJob(request_id, form, options, language, lora)

    def _resolve_model(self, name: Optional[str]) -> Optional[LoRARequest]:
        if (self.chat_models is not None and not self.serves(name) and name is not None
                and (self.chat_models.is_base_model(name) or name in self.chat_models.lora_requests)):
            raise BadRequestError(f"The model `{name}` is a chat model and cannot transcribe audio; send "
                                  f"model={self.models.model_name!r} (the Whisper model).", param="model")
        return self.models.resolve_model_name(name)   # 404 for a name nobody serves

    async def _read_upload(self, upload: UploadFile) -> bytes:
        """The upload's bytes, at most the audio limit (413 above it)."""
        limit = self.engine_client.processor.audio_limits.max_audio_bytes
        size = upload.size
        if size is None or size <= limit:
            data = await upload.read(limit + 1)
            size = len(data)
        if size > limit:
            raise PayloadTooLargeError(f"file: the audio file is {size} bytes, above the limit of "
                                       f"{limit} bytes ({limit / (1 << 20):g} MiB); send a shorter or more "
                                       "compressed recording.", param="file")
        if not data:
            raise BadRequestError("file: the uploaded file is empty (0 bytes).", param="file")
        return data

    # ------------------------------------------------------------------------------------
    # Engine requests
    # ------------------------------------------------------------------------------------
    async def _decode(self, data: bytes) -> DecodedAudio:
        """Decode, resample and check in a worker thread (seconds for long files): not on the event loop."""
        try:
            return await asyncio.to_thread(self._decode_now, data)
        except AudioError as e:
            raise BadRequestError(f"file: {e}", param="file") from e

    def _decode_now(self, data: bytes) -> DecodedAudio:
        audio = load_audio(data, self.engine_client.processor.audio_limits)
        self.transcriber.check_audio(audio)
        return audio

    async def _start(self, job: AudioJob, data: bytes) -> RunningTranscription:
        """Decode, detect the language if needed, and submit every window."""
        audio = await self._decode(data)
        # Voice-activity chunking runs a model over the whole recording: off the event loop.
        chunks = await asyncio.to_thread(self.transcriber.chunks, audio)
        language = job.language
        if language is None:
            language = await self._detect_language(job, audio, chunks)
        plans = self.transcriber.windows(audio, job.options, language, chunks)
        run = RunningTranscription(job, audio, language, [WindowOutput(p) for p in plans])
        kind = RequestOutputKind.DELTA if job.form.stream else RequestOutputKind.FINAL_ONLY
        requests = []
        for plan in plans:
            prompt, params = self.transcriber.window_request(plan, job.options)
            params.output_kind = kind
            requests.append((prompt, params, f"{job.request_id}-{plan.index}"))
        run.streams = await self._submit(requests, job.lora)
        return run

    async def _detect_language(self, job: AudioJob, audio: DecodedAudio, chunks: list) -> str:
        prompt, params = self.transcriber.detection_request(audio, chunks)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        async for out in self.engine_client.generate(prompt, params, f"{job.request_id}-lang",
                                                     lora_request=job.lora):
            final = out
        return self.transcriber.language_of(final)

    async def _submit(self, requests: list[tuple[dict, SamplingParams, str]],
                      lora: Optional[LoRARequest]) -> list[RequestStream]:
        """Add every window request; if one is refused or the caller is cancelled (client gone), none is
        left running."""
        if not requests:   # voice-activity chunking found no speech
            return []
        tasks = [asyncio.ensure_future(self.engine_client.add_request(prompt, params, rid, lora_request=lora))
                 for prompt, params, rid in requests]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for task in tasks:   # a request added after all is aborted as it arrives
                task.cancel()
                task.add_done_callback(_abort_added)
            raise
        errors = [t.exception() for t in tasks if t.exception() is not None]
        if errors:
            for task in tasks:
                _abort_added(task)
            raise errors[0]
        return [t.result() for t in tasks]

    async def _transcribe(self, job: AudioJob, data: bytes) -> TranscriptionResult:
        run = await self._start(job, data)
        try:
            async for i, out in merge_streams(run.streams):
                run.windows[i].add(out)
        finally:
            run.abort()
        alignments = None
        if job.options.word_timestamps:
            alignments = []
            for window in run.windows:   # one at a time: each is a pass between engine steps
                call = self.transcriber.alignment_call(window.plan, window.output, job.options, run.language)
                alignments.append(await self.engine_client.call_engine(call) if call is not None else None)
        return run.result(self.transcriber, alignments)

    async def _events(self, run: RunningTranscription) -> AsyncIterator[str]:
        deltas = TranscriptDeltas()
        head = 0   # the earliest window not finished: the only one whose text may go out as it grows
        try:
            async for i, out in merge_streams(run.streams):
                run.windows[i].add(out)
                while head < len(run.windows):
                    window = run.windows[head]
                    piece = deltas.push(window.take_new_text(self.transcriber))
                    if piece:
                        yield sse_event(transcript_text_delta(piece))
                    if not window.finished:
                        break
                    head += 1
            result = run.result(self.transcriber)
            yield sse_event(transcript_text_done(result.text, usage=duration_usage(result.duration_s)))
        except Exception as e:  # noqa: BLE001 - reported in-band, as the other stream routes do
            err = to_openai_error(e)
            yield sse_event(error_body(err.message, err.err_type, err.status_code, err.param))
        finally:
            run.abort()
        yield SSE_DONE

    @staticmethod
    async def _guard_disconnect(raw_request: Request, work):
        """``run_unless_disconnected``: None when the client left (its requests are aborted)."""
        return await run_unless_disconnected(raw_request, work)


def _abort_added(task: asyncio.Future) -> None:
    if task.done() and not task.cancelled() and task.exception() is None:
        task.result().abort()


def _param_of(message: str) -> Optional[str]:
    """The form field a ``Transcriber.check_options`` error is about."""
    lowered = message.lower()
    if "temperature" in lowered:
        return "temperature"
    if "cannot translate" in lowered:
        return "model"
    if "prompt" in lowered and "language" not in lowered:
        return "prompt"
    if "language" in lowered or "cannot transcribe" in lowered:
        return "language"
    return None


async def read_audio_form(raw_request: Request) -> tuple[TranscriptionRequest, UploadFile]:
    """The multipart form: its text fields validated (400 naming the field), and the ``file`` upload."""
    form = await raw_request.form(max_files=1, max_fields=MAX_FORM_FIELDS)
    upload = form.get("file")
    try:
        if upload is None:
            raise BadRequestError("file: an audio file is required (multipart/form-data field 'file').",
                                  param="file")
        if not isinstance(upload, UploadFile):
            raise BadRequestError("file: must be a file upload (multipart/form-data), not a text field.",
                                  param="file")
        fields: dict[str, object] = {}
        for key, value in form.multi_items():
            if key == "file" or value == "":
                continue
            if isinstance(value, UploadFile):
                raise BadRequestError(f"{key}: expected a text field, got a file.", param=key)
            if key in GRANULARITY_FIELDS:
                fields.setdefault("timestamp_granularities", []).append(value)
            else:
                fields[key] = value
        try:
            request = TranscriptionRequest.model_validate(fields)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
    except BaseException:
        await form.close()
        raise
    return request, upload
