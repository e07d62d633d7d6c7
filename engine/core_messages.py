"""The messages between an engine core and its client (``AsyncLLM``, ``LLMEngine``).

Client -> core (``EngineCommand``): ``AddRequest``, ``AbortRequests``, ``CallEngine``, ``InjectFault``,
``Shutdown``. Core -> client (``CoreMessage``): one ``EngineCoreOutputs`` per step (every request's
new token ids of that step, plus the scheduler's stats), ``CallResult`` for each ``CallEngine``,
``EngineDead`` once. A ``CallEngine`` carries one ``EngineCall``: a dataclass per thing a client may
ask of the core between steps (``AddLoRA``, ``RemoveLoRA``, ``ListLoRAs``, ``ResetPrefixCache``,
``GetStats``, ``AlignmentScores``), which the core tells apart by type. The same objects travel through an in-process
queue (engine thread) or, pickled, through a pipe (engine process); ``EngineCoreOutputs`` pickles as
columns, so a step's message costs a few lists, not one object per request.

The core never sees text it has to produce: detokenization, stop strings and ``RequestOutput``s
are the client's (``engine/output_processor.py``), as in vLLM V1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union, get_args

from engine.outputs import EngineCoreOutput, SchedulerStats
from engine.request import EngineRequest

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.processor import Processor
    from lora.request import LoRARequest


# ----------------------------------------------------------------------------------------
# Client -> core
# ----------------------------------------------------------------------------------------
@dataclass
class AddRequest:
    """Queue one user request: its ``n`` processed sequences (validated by the client)."""

    request_id: str
    """The user's request id (parent of the sequences); named in a rejection."""
    children: list[EngineRequest]
    """One sequence per sample (``n`` of them; ids ``{request_id}#{index}`` when n > 1)."""


@dataclass
class AbortRequests:
    """Finish sequences now (client gone, stop string found by the client); frees their blocks."""

    request_ids: list[str]
    """Sequence (child) ids; unknown or finished ones are ignored."""


@dataclass(frozen=True)
class AddLoRA:
    """Load an adapter so that requests can name it (``EngineCore.add_lora``); answers True."""

    lora_request: "LoRARequest"
    """The adapter, with the weights the client read (``LoRARequest.adapter``), else read by the core's
    loader thread (a client in another process: ``AdapterUploads.ship_weights``)."""
    checked: bool = False
    """The client checked the adapter (``AdapterReader.check``): the core reads it without checking it
    again on its step loop; False: the core checks it first, raising the adapter's errors to the caller."""


@dataclass(frozen=True)
class RemoveLoRA:
    """Unload an adapter once its requests finished (``EngineCore.remove_lora``); answers whether it
    was loaded."""

    lora_name: str
    """The adapter's name."""


@dataclass(frozen=True)
class ListLoRAs:
    """The ``LoRARequest`` of every loaded adapter (``EngineCore.list_loras``)."""


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every cached prefix (``EngineCore.reset_prefix_cache``); answers False, having done
    nothing, while blocks are in use."""


@dataclass(frozen=True)
class GetStats:
    """The scheduler's ``SchedulerStats`` now (``EngineCore.get_stats``)."""


@dataclass(frozen=True)
class AlignmentScores:
    """Word timestamps of a finished Whisper window (``engine.runner.alignment``): its audio encoded again and
    one teacher-forced decoder pass over ``token_ids``; answers the alignment heads' scaled ``Q K^T``, a
    float32 numpy array [heads, len(token_ids), num_positions]."""

    audio: Any
    """The window's encoder input (``multimodal.audio_processing.AudioInput``, as the request had it)."""
    token_ids: tuple[int, ...]
    """Start-of-transcript sequence, ``<|notimestamps|>``, the window's text tokens, ``<|endoftext|>``."""
    num_positions: int
    """Encoder positions that hold the window's audio (0.02 s each)."""


EngineCall = Union[AddLoRA, RemoveLoRA, ListLoRAs, ResetPrefixCache, GetStats, AlignmentScores]
"""What a client may ask of the core between steps (``CallEngine``)."""


def refuse_non_call(call: object) -> None:
    """Raise TypeError, naming the engine calls, unless ``call`` is an ``EngineCall``."""
    if not isinstance(call, get_args(EngineCall)):
        names = ", ".join(c.__name__ for c in get_args(EngineCall))
        raise TypeError(f"{call!r} is not an engine call; send one of {names}.")


@dataclass
class CallEngine:
    """Run one ``EngineCall`` between steps; answered by a ``CallResult``."""

    call_id: int
    """Chosen by the client; echoed in the ``CallResult``."""
    call: EngineCall
    """What to run (pickled, its weights included, in the engine-process mode)."""


@dataclass
class InjectFault:
    """Test hook: a fault in the loop or in the next steps.

    ``num_steps == 0``: the loop raises ``error`` before its next step, and dies of it.
    ``num_steps > 0``: each of the next ``num_steps`` steps raises ``error`` once the model runner has
    launched it, as a failing runner would (``EngineCore.inject_step_faults``).
    """

    error: BaseException
    """What the loop (or the step) raises."""
    num_steps: int = 0
    """0: kill the loop now; N > 0: fail the next N steps."""


@dataclass
class Shutdown:
    """Leave the loop after the commands queued before this one."""


EngineCommand = Union[AddRequest, AbortRequests, CallEngine, InjectFault, Shutdown]


# ----------------------------------------------------------------------------------------
# Core -> client
# ----------------------------------------------------------------------------------------
@dataclass
class EngineCoreOutputs:
    """Everything one step (or one idle command drain) produced, in one message."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    """One entry per sequence with news this step: new token ids (+ logprobs), finish reason."""
    stats: Optional[SchedulerStats] = None
    """The scheduler after this step (None: unchanged)."""
    rejected: dict[str, BaseException] = field(default_factory=dict)
    """User request id -> why the core refused its ``AddRequest`` (nothing of it runs)."""
    failed: dict[str, BaseException] = field(default_factory=dict)
    """Sequence (child) id -> why the core ended it early: ``EngineStepError`` (its step raised, 500)
    or a LoRA error (its adapter could not be read from disk, 4xx). The core freed it already."""

    def __reduce__(self) -> tuple:
        # Columns: lists of ints and strings pickle cheaper than one dataclass per entry.
        outs = self.outputs
        extras = {i: (o.new_logprobs, o.new_prompt_logprobs, o.finish_reason, o.stop_reason,
                      o.num_cached_tokens)
                  for i, o in enumerate(outs)
                  if o.new_logprobs is not None or o.new_prompt_logprobs is not None
                  or o.finish_reason is not None or o.num_cached_tokens}
        return (_rebuild_outputs, ([o.req_id for o in outs], [o.new_token_ids for o in outs], extras,
                                   self.stats, self.rejected, self.failed))


def _rebuild_outputs(req_ids: list[str], new_token_ids: list[list[int]], extras: dict[int, tuple],
                     stats: Optional[SchedulerStats], rejected: dict[str, BaseException],
                     failed: dict[str, BaseException]) -> EngineCoreOutputs:
    outputs = [EngineCoreOutput(rid, ids) for rid, ids in zip(req_ids, new_token_ids)]
    for i, (logprobs, prompt_logprobs, finish_reason, stop_reason, num_cached) in extras.items():
        o = outputs[i]
        o.new_logprobs, o.new_prompt_logprobs = logprobs, prompt_logprobs
        o.finish_reason, o.stop_reason, o.num_cached_tokens = finish_reason, stop_reason, num_cached
    return EngineCoreOutputs(outputs, stats, rejected, failed)


@dataclass
class CallResult:
    """The answer to one ``CallEngine``."""

    call_id: int
    """The ``CallEngine``'s id."""
    value: Any = None
    """What the call returned (None when it raised)."""
    error: Optional[BaseException] = None
    """What it raised (ValueError and the LoRA errors keep their 4xx meaning)."""


@dataclass
class EngineDead:
    """The loop stopped (a fatal step fault, an exception in the loop, or the process is gone); sent once."""

    message: str
    """Why, for the ``EngineDeadError`` every waiting caller gets."""


CoreMessage = Union[EngineCoreOutputs, CallResult, EngineDead]


# ----------------------------------------------------------------------------------------
# Start-up
# ----------------------------------------------------------------------------------------
@dataclass
class EngineFacts:
    """What a client needs from the engine, read once after it is built."""

    model_name: str
    """The checkpoint's name (or ``--served-model-name``)."""
    max_model_len: int
    """Context length (prompt + output) per request, in tokens."""
    engine_config: "EngineConfig"
    """The resolved configs."""
    tokenizer: Any
    """The engine's tokenizer: prompts, chat templates, detokenization (client side)."""
    processor: "Processor"
    """The engine's stateless ``Processor`` (a pickled copy in the engine-process mode)."""
    default_sampling_params: dict
    """The checkpoint's generation_config defaults (``SamplingParams`` keyword arguments)."""
    lora_enabled: bool
    """Whether requests may name adapters."""


@dataclass
class EngineReady:
    """The engine process built its engine (first message on its pipe)."""

    facts: EngineFacts
    """See ``EngineFacts``."""


@dataclass
class EngineStartupFailed:
    """The engine process could not build its engine (first and last message on its pipe)."""

    message: str
    """``Type: message`` of the error."""
    traceback: str
    """The child's formatted traceback."""

