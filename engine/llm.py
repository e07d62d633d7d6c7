"""Offline API, as vLLM's: ``LLM(model, ...)``, ``llm.generate(prompts, params)``, ``llm.chat(messages)``."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import weakref
from typing import Optional, Sequence, Union

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("chorus.llm")


class LLM:
    """Generate from many prompts at once with continuous batching.

    Args: ``model`` (HF dir, GGUF file, or None for the default SmolLM2-135M-Instruct) and any
    ``EngineArgs`` keyword (``dtype``, ``max_model_len``, ``block_size``, ``enable_prefix_caching``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``seed``, ``enable_lora``, ``max_loras``, ...).

    Lifecycle: ``close()`` (or leaving ``with LLM(...) as llm:``) releases the engine: tensor-parallel
    workers joined and their process group destroyed (so another engine may form one), the model,
    KV cache and adapters freed, cached GPU memory returned. An LLM that is garbage (``del llm``, then
    ``gc.collect()`` or simply the last reference gone) is closed the same way.
    """

    def __init__(self, model: Optional[str] = None, **kwargs) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model=model, **kwargs))
        self._counter = itertools.count()
        weakref.finalize(self, self.llm_engine.close).atexit = False   # holds the engine, not this LLM

    def close(self) -> None:
        """Release the engine (``LLMEngine.close``); idempotent. Later calls raise EngineDeadError."""
        self.llm_engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config defaults (vLLM's behaviour)."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: bool = True, lora_request=None, priority: Optional[list[int]] = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt comes back, in input order.

        A prompt is a string, a list of token ids, or a dict with ``prompt`` or ``prompt_token_ids``.
        ``sampling_params`` and ``lora_request`` may be one value or a list aligned with the prompts.
        Bad input raises ValueError before any request is queued.

        A request that the engine fails on the way (a step that raised and was recovered from, an
        adapter whose files went missing) does not take the batch down: its output comes back with
        ``error`` set (``RequestOutput.error``) and finish_reason 'error', every other output intact,
        and a warning is logged; check ``error`` where a failure matters. Only a fatal fault raises
        (EngineDeadError: the engine is unusable), and so does a KeyboardInterrupt (the batch's
        requests are aborted first, so the LLM stays usable).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        n = len(prompts)
        params = self._per_prompt(sampling_params or self.get_default_sampling_params(), n, "sampling_params")
        loras = self._per_prompt(lora_request, n, "lora_request")
        prios = self._per_prompt(priority, n, "priority") if isinstance(priority, list) else [priority or 0] * n
        engine = self.llm_engine
        # Validate everything first so one bad prompt leaves the engine untouched.
        rids = [str(next(self._counter)) for _ in prompts]
        processed = self._process_all(rids, prompts, params, loras, prios)
        # A bad adapter failed in processing (its files are read there), before anything is queued.
        for rid, (text, children) in zip(rids, processed):
            engine.add_processed(rid, text, children)
        return self._run(n, use_tqdm, rids)

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True,
             lora_request=None, chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Optional[list[dict]] = None,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several (a list of lists), through the chat template.

        Content may be a string or OpenAI content parts: ``{"type": "text", "text": ...}``,
        ``{"type": "image_url", "image_url": {"url": ...}}`` (http(s), data: or file:// URL, or a
        file path), ``{"type": "image_pil", "image_pil": PIL.Image}`` or ``{"type": "image", "image":
        PIL image | path | URL | bytes}``; each image becomes the model's placeholder in the
        template and goes to the engine as ``multi_modal_data``.

        ``chat_template``: template TEXT (as vLLM's ``LLM.chat``; never a file path) replacing the
        model's for this call; rendered in jinja2's sandbox within the engine's ``TemplateLimits``
        (``engine/chat_template.py``), like every template.

        ``tools`` (OpenAI function tools) and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``)
        reach the template as in a served request; the reply is the model's text (read its calls with a
        ``engine.tool_calls`` parser, or constrain it with ``SamplingParams(structured_outputs=...)`` and
        ``engine.tool_calls.tool_choice``'s schemas).

        Rendered and tokenized by the server's renderer (``engine/chat_render.py``), so a conversation
        gives the same token ids here and over HTTP.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        renderer = self.llm_engine.processor.chat_renderer
        prompts = [renderer.render(conv, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, chat_template=chat_template,
                                   template_kwargs=chat_template_kwargs, tools=tools, offline=True).engine_prompt()
                   for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ------------------------------------------------------------------ helpers
    # ------------------------------------------------------------------ transcribe (Whisper)
    def transcribe(self, audio, *, language: Optional[str] = None, task: str = "transcribe",
                   prompt: Optional[str] = None, timestamps: bool = False, temperature: float = 0.0,
                   lora_request=None, use_tqdm: bool = False, word_timestamps: bool = False):
        """Transcribe (or translate into English, ``task="translate"``) one recording or a list of them
        with a Whisper model -> ``engine.transcription.TranscriptionResult`` (``text``, timed ``segments``,
        ``language``) per recording.

        ``audio``: a file path (wav, flac, ogg, mp3; m4a/webm with PyAV), encoded bytes, a binary file
        object or ``(array, sample_rate)``; or a list of those. Long audio is cut into 30 s windows at quiet
        points, all windows of all recordings run as parallel requests. ``language`` None: English on
        English-only models, detected from the first window on multilingual ones. ``word_timestamps``: also
        time every word (``result.words``; one alignment pass per window; not with enable_lora). ValueError (AudioError)
        for bad audio or options; a window the engine failed raises its ``RequestOutput.error``.
        """
        from engine.transcription import TranscriptionOptions
        from multimodal.audio import load_audio

        transcriber = self.llm_engine.processor.transcriber
        if transcriber is None:
            raise ValueError(f"transcribe: {self.llm_engine.model_name} is not a Whisper model.")
        single = not isinstance(audio, list)
        recordings = [audio] if single else list(audio)
        if word_timestamps and self.llm_engine.engine_config.lora_config is not None:
            raise ValueError("transcribe: word timestamps are not available with enable_lora (the alignment pass "
                             "runs the base weights).")
        options = TranscriptionOptions(task=task, language=language, prompt=prompt, timestamps=timestamps,
                                       temperature=temperature, word_timestamps=word_timestamps)
        code = transcriber.check_options(options)
        limits = self.llm_engine.processor.audio_limits
        decoded = [load_audio(a, limits) for a in recordings]
        for d in decoded:
            transcriber.check_audio(d)
        chunks = [transcriber.chunks(d) for d in decoded]
        languages = [code] * len(decoded)
        if code is None:   # detect each recording's language from its first window
            detect = [transcriber.detection_request(d, c) for d, c in zip(decoded, chunks)]
            outs = self.generate([r[0] for r in detect], [r[1] for r in detect], use_tqdm=False,
                                 lora_request=lora_request)
            _raise_first_error(outs)
            languages = [transcriber.language_of(o) for o in outs]
        plans = [transcriber.windows(d, options, lang, c) for d, lang, c in zip(decoded, languages, chunks)]
        requests = [transcriber.window_request(w, options) for windows in plans for w in windows]
        outs = self.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=use_tqdm,
                             lora_request=lora_request)
        _raise_first_error(outs)   # a recording with a missing window has no transcription
        results, start = [], 0
        for d, windows, lang in zip(decoded, plans, languages):
            window_outs = outs[start:start + len(windows)]
            alignments = None
            if word_timestamps:
                calls = [transcriber.alignment_call(w, o, options, lang) for w, o in zip(windows, window_outs)]
                alignments = [self.llm_engine.core.call(c) if c is not None else None for c in calls]
            results.append(transcriber.assemble(d, windows, window_outs, options, lang, alignments))
            start += len(windows)
        return results[0] if single else results

    def _process_all(self, rids, prompts, params, loras, prios) -> list:
        """``Processor.process`` of every prompt, in order; prompts with media (loading, decoding,
        resizing, hashing: milliseconds each) on ``mm_processor_workers`` threads."""
        processor = self.llm_engine.processor

        def one(args):
            rid, prompt, p, lora, prio = args
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            return processor.process(rid, prompt, p, lora, prio)

        jobs = list(zip(rids, prompts, params, loras, prios))
        num_media = sum(isinstance(pr, dict) and pr.get("multi_modal_data") is not None for pr in prompts)
        if num_media < 2:
            return [one(job) for job in jobs]
        workers = self.llm_engine.engine_config.mm_config.mm_processor_workers
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="chorus-media") as pool:
            return list(pool.map(one, jobs))

    @staticmethod
    def _per_prompt(value, n: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name}: got {len(value)} values for {n} prompts.")
            return list(value)
        return [value] * n

    def _run(self, n: int, use_tqdm: bool, order: list[str]) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and n > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=n, desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(engine.output_processor.parents))   # the LLM stays usable
            raise
        finally:
            if bar is not None:
                bar.close()
        failed = [done[rid] for rid in order if rid in done and done[rid].error is not None]
        if failed:
            logger.warning("%d of %d request(s) failed (their outputs carry the error); the first: %s",
                           len(failed), n, failed[0].error)
        return [done[rid] for rid in order if rid in done]


def _raise_first_error(outputs: list[RequestOutput]) -> None:
    """Raise the error of the first output the engine failed, if any."""
    for out in outputs:
        if out.error is not None:
            raise out.error
