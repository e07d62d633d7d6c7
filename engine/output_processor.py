"""Engine-core outputs -> user ``RequestOutput``s: detokenize, stop strings, logprobs, n > 1.

Client side (the API process, or the offline ``LLMEngine``), as vLLM V1's: the engine core sends
token ids only. The only loop over the batch on the way out. Stop strings are found here (the
core never sees text), so a sequence they end is returned in ``reqs_to_abort`` for the client to
abort in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from engine.detokenizer import IncrementalDetokenizer, decode_token
from engine.outputs import (CompletionOutput, EngineCoreOutput, Logprob, LogprobsLists, PromptLogprobs,
                            RequestMetrics, RequestOutput, SampleLogprobs)
from engine.request import EngineRequest
from engine.sampling_params import RequestOutputKind


@dataclass
class ParentRequest:
    """The user's request; fans out into ``n`` children (ids ``{request_id}#{index}``:
    ``processor.child_request_id``)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    lora_request: object
    num_children: int
    metrics: RequestMetrics
    prompt_logprobs: Optional[PromptLogprobs] = None
    wants_prompt_logprobs: bool = False
    num_cached_tokens: int = 0
    sent_prompt_logprobs: bool = False
    children: dict[int, "ChildState"] = field(default_factory=dict)
    child_ids: list[str] = field(default_factory=list)
    """The sequences' engine request ids, by sample index."""


@dataclass
class ChildState:
    index: int
    parent: ParentRequest
    detok: IncrementalDetokenizer
    stop: list[str]
    include_stop: bool
    hold_back: int
    """Characters held back while streaming so a stop string is never emitted in part."""
    num_logprobs: Optional[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None
    text: str = ""
    """Text so far, already cut at a stop string."""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_sent_logprobs: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    final_sent: bool = False
    """DELTA mode: the finishing delta went out."""


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, ChildState] = {}
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ registration
    def add_request(self, parent_id: str, children: list[EngineRequest], prompt: Optional[str]) -> None:
        first = children[0]
        p = first.sampling_params
        lora = first.lora_request   # kept without the adapter's weights (those went to the engine)
        parent = ParentRequest(
            request_id=parent_id, prompt=prompt, prompt_token_ids=first.prompt_token_ids,
            output_kind=p.output_kind, lora_request=lora and lora.without_adapter(), num_children=len(children),
            metrics=RequestMetrics(arrival_time=first.arrival_time),
            wants_prompt_logprobs=p.prompt_logprobs is not None)
        if parent.wants_prompt_logprobs:
            parent.prompt_logprobs = [None]
        self.parents[parent_id] = parent
        for index, child in enumerate(children):
            sp = child.sampling_params
            state = ChildState(
                index=index, parent=parent,
                detok=IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, sp.skip_special_tokens),
                stop=list(sp.stop), include_stop=sp.include_stop_str_in_output,
                hold_back=sp._output_text_buffer_length, num_logprobs=sp.logprobs,
                logprobs=[] if sp.logprobs is not None else None,
                cumulative_logprob=0.0 if sp.logprobs is not None else None)
            parent.children[index] = state
            parent.child_ids.append(child.request_id)
            self.children[child.request_id] = state

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def abort_requests(self, parent_ids: list[str]) -> tuple[list[RequestOutput], list[str]]:
        """Finish user requests now (finish_reason 'abort'; unknown ids are ignored).

        Returns:
            Their final outputs, and the sequence ids the engine core must abort.
        """
        outs, child_ids = [], []
        for pid in parent_ids:
            parent = self.parents.get(pid)
            if parent is None:
                continue
            for cid in parent.child_ids:
                c = self.children[cid]
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    child_ids.append(cid)
            outs.append(self._make_output(parent, final=True))
            self._drop(parent)
        return [o for o in outs if o is not None], child_ids

    # ------------------------------------------------------------------ per step
    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        now = time.time()
        touched: dict[str, ParentRequest] = {}
        reqs_to_abort: list[str] = []
        for co in core_outputs:
            c = self.children.get(co.req_id)
            if c is None:
                continue
            parent = c.parent
            m = parent.metrics
            if co.new_prompt_logprobs is not None and parent.prompt_logprobs is not None and c.index == 0:
                parent.prompt_logprobs.extend(self._logprob_dicts(co.new_prompt_logprobs))
            if co.new_token_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = now
                parent.num_cached_tokens = max(parent.num_cached_tokens, co.num_cached_tokens)
                self._append_tokens(c, co)
            if c.finish_reason is None and self._check_stop_strings(c):
                reqs_to_abort.append(co.req_id)
            if co.finish_reason is not None and c.finish_reason is None:
                c.finish_reason, c.stop_reason = co.finish_reason, co.stop_reason
            touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            out = self._make_output(parent, final=False)
            if out is not None:
                outputs.append(out)
            if _all_finished(parent):
                self._drop(parent)   # after building its last output
        return outputs, reqs_to_abort

    def _append_tokens(self, c: ChildState, co: EngineCoreOutput) -> None:
        c.token_ids.extend(co.new_token_ids)
        if c.logprobs is not None and co.new_logprobs is not None:
            for d, lp in zip(self._logprob_dicts(co.new_logprobs), co.new_logprobs.logprobs):
                c.logprobs.append(d)
                c.cumulative_logprob += lp[0]
        # The token that ends by EOS or a stop id is kept in token_ids but not in the text.
        ids = co.new_token_ids
        if co.finish_reason == "stop" and not isinstance(co.stop_reason, str) and not c.include_stop:
            ids = ids[:-1]
        if ids:
            c.text += c.detok.step(ids)

    def _check_stop_strings(self, c: ChildState) -> bool:
        if not c.stop:
            return False
        text = c.text
        # Only new text can complete a stop string: search from just before it.
        search_from = max(0, c.num_sent_chars - max(len(s) for s in c.stop))
        best = None
        for s in c.stop:
            i = text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        c.text = text[:i + len(s)] if c.include_stop else text[:i]
        c.finish_reason, c.stop_reason = "stop", s
        return True

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        out = []
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            d: dict[int, Logprob] = {}
            d[ids[0]] = Logprob(lps[0], rank, self._decode_one(ids[0]))
            for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                if tid not in d:
                    d[tid] = Logprob(lp, r, self._decode_one(tid))
            out.append(d)
        return out

    def _decode_one(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self._token_text[token_id] = decode_token(self.tokenizer, token_id)
        return t

    def _drop(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.child_ids:
            self.children.pop(cid, None)
        parent.metrics.finished_time = time.time()

    # ------------------------------------------------------------------ building outputs
    def _make_output(self, parent: ParentRequest, final: bool) -> Optional[RequestOutput]:
        finished = _all_finished(parent)
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for index in sorted(parent.children):
            c = parent.children[index]
            if kind == RequestOutputKind.DELTA:
                co = self._delta(c)
                if co is None:
                    continue
            else:
                co = CompletionOutput(index=index, text=c.text, token_ids=list(c.token_ids),
                                      cumulative_logprob=c.cumulative_logprob,
                                      logprobs=list(c.logprobs) if c.logprobs is not None else None,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            completions.append(co)
        if not completions and not finished:
            return None
        prompt_logprobs = parent.prompt_logprobs
        if kind == RequestOutputKind.DELTA and parent.wants_prompt_logprobs:
            # Prompt logprobs go out once, with the first delta that carries tokens.
            if parent.sent_prompt_logprobs or not any(c.token_ids for c in completions):
                prompt_logprobs = None
            else:
                parent.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=completions, finished=finished,
            num_cached_tokens=parent.num_cached_tokens, metrics=parent.metrics,
            lora_request=parent.lora_request)

    def _delta(self, c: ChildState) -> Optional[CompletionOutput]:
        finished = c.finish_reason is not None
        visible = len(c.text) if finished else max(c.num_sent_chars, len(c.text) - c.hold_back)
        text = c.text[c.num_sent_chars:visible]
        toks = c.token_ids[c.num_sent_tokens:]
        lps = c.logprobs[c.num_sent_logprobs:] if c.logprobs is not None else None
        if not text and not toks and not finished:
            return None
        if finished and c.final_sent:
            return None
        c.num_sent_chars, c.num_sent_tokens = visible, len(c.token_ids)
        if c.logprobs is not None:
            c.num_sent_logprobs = len(c.logprobs)
        c.final_sent = finished
        return CompletionOutput(index=c.index, text=text, token_ids=toks,
                                cumulative_logprob=c.cumulative_logprob,
                                logprobs=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def _all_finished(parent: ParentRequest) -> bool:
    children = parent.children
    if len(children) == 1:
        return children[0].finish_reason is not None
    return all(c.finish_reason is not None for c in children.values())
