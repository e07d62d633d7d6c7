"""One chat renderer for the server (``/v1/chat/completions``, ``/tokenize``) and the offline ``LLM.chat``.

OpenAI messages -> template messages and media sources (``engine/chat_utils.py``) -> the chat template's
text (jinja2's sandbox, within ``TemplateLimits``: ``engine/chat_template.py``) -> its token ids. The text
is tokenized here and only here: the processor takes the ids as ``prompt_token_ids`` (the text rides along
for echo and logs) and expands the image placeholders in them.

Blocking CPU work: the server calls ``ChatRenderer.render`` from a worker thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from engine.chat_template import ChatTemplateError, TemplateLimits, render_chat_template, select_template
from engine.chat_utils import ChatMessageError, parse_chat_messages


@dataclass
class RenderedChat:
    """A conversation rendered and tokenized, ready for the processor."""

    text: str
    """The templated conversation (one image placeholder per image)."""
    token_ids: list[int]
    """``text`` tokenized (the processor does not tokenize it again)."""
    images: list[Any] = field(default_factory=list)
    """The conversation's image sources (URLs; offline also PIL images, paths, bytes) in placeholder order;
    loaded by the processor."""
    audios: list[Any] = field(default_factory=list)
    """The conversation's audio sources (URLs, data URLs; offline also (array, rate) pairs, paths, bytes) in
    placeholder order; loaded by the processor."""

    def engine_prompt(self) -> dict[str, Any]:
        """The processor's prompt dict (with ``multi_modal_data`` when there are images or audios)."""
        prompt: dict[str, Any] = {"prompt": self.text, "prompt_token_ids": list(self.token_ids)}
        media = {k: list(v) for k, v in (("image", self.images), ("audio", self.audios)) if v}
        if media:
            prompt["multi_modal_data"] = media
        return prompt


class ChatRenderer:
    """Renders conversations for one model.

    Args:
        tokenizer: the model's tokenizer; its ``chat_template`` is the operator's template (the
            tokenizer's own, or ``--chat-template``'s, read once by ``engine.loader.tokenizer``).
        template_limits: time and size bounds of every render.
        takes_images: the model takes media (image parts are accepted; else they are a ValueError).
        takes_audio: the model takes audio in its prompt (audio parts are accepted; else a ValueError).
    """

    def __init__(self, tokenizer: Any, template_limits: TemplateLimits, takes_images: bool,
                 takes_audio: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = getattr(tokenizer, "chat_template", None)
        """The operator's chat template text; a dict of named templates for some tokenizers."""
        self.template_limits = template_limits
        """Time and size bounds of every chat template render (``engine.chat_template``)."""
        self.takes_images = takes_images
        """Image content parts are accepted (the model takes media)."""
        self.takes_audio = takes_audio
        """Audio content parts are accepted (an audio-language model)."""

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, add_special_tokens: bool = False,
               chat_template: Optional[str] = None, template_kwargs: Optional[Mapping[str, Any]] = None,
               tools: Optional[Sequence[Mapping[str, Any]]] = None, offline: bool = False) -> RenderedChat:
        """Render ``messages`` through ``chat_template`` (template TEXT, never a file path) or, when it is
        None or empty, the operator's template; then tokenize the text once.

        Args:
            messages: OpenAI chat messages (``engine/chat_utils.py`` lists the content parts).
            add_generation_prompt: end with the assistant's turn opening (ignored with
                ``continue_final_message``).
            continue_final_message: end inside the final message, so the reply continues it.
            add_special_tokens: let the tokenizer add its special tokens (BOS); off by default, as the
                template writes its own.
            chat_template: a template for this render instead of the operator's.
            template_kwargs: more template variables (``chat_template_kwargs``).
            tools: OpenAI function tools, the template's ``tools`` (over one in ``template_kwargs``).
            offline: accept the offline part types and sources (``chat_utils.parse_chat_messages``).

        Raises:
            ChatMessageError: a malformed message or part, or an image for a text-only model.
            ChatTemplateError (a ValueError, ``param`` naming the field to blame): no messages, no
                template, the template does not compile, raised, or crossed a bound.
            TypeError: ``template_kwargs`` names one of ``render_chat_template``'s own arguments.
        """
        parsed = parse_chat_messages(tool_call_arguments_as_objects(messages), takes_images=self.takes_images,
                                     offline=offline, takes_audio=self.takes_audio)
        if not parsed.messages:
            raise ChatTemplateError("messages: at least one message is required.", param="messages")
        kwargs = dict(template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = list(tools)
        template = self._template(chat_template, kwargs.get("tools"))
        text = render_chat_template(
            template, parsed.messages, limits=self.template_limits,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            special_tokens=getattr(self.tokenizer, "special_tokens_map", None),
            from_request=bool(chat_template), **kwargs)
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return RenderedChat(text=text, token_ids=list(token_ids), images=parsed.images, audios=parsed.audios)

    def _template(self, chat_template: Optional[str], tools: Any) -> str:
        """The template text to render: ``chat_template`` when given, else the operator's."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise ChatTemplateError("chat_template: expected the template text (a string).",
                                    param="chat_template")
        if chat_template:
            return chat_template
        try:
            template = select_template(self.chat_template, tools)
        except ValueError as e:
            raise ChatTemplateError(f"chat_template: {e}", param="messages") from e
        if template is None:
            raise ChatTemplateError("chat_template: the model's tokenizer has no chat template; pass "
                                    "--chat-template.", param="messages")
        return template


def tool_call_arguments_as_objects(messages: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """``messages`` with each assistant ``tool_calls[j].function.arguments`` JSON string read into its
    value (``{}`` when empty), as vLLM does: chat templates write the arguments with ``tojson``. The
    messages given are not changed (changed ones are copies).

    Raises:
        ChatMessageError: ``tool_calls`` is not a list of calls with a ``function`` object, or
            ``arguments`` is not JSON.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return messages   # parse_chat_messages names the problem
    out: list[Mapping[str, Any]] = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if calls is None or message.get("role") != "assistant":
            out.append(message)
            continue
        where = f"messages[{i}].tool_calls"
        if not isinstance(calls, list):
            raise ChatMessageError(f"{where}: expected a list of tool calls, got {type(calls).__name__}.")
        read = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping):
                raise ChatMessageError(f"{where}[{j}]: expected a call like {{'id': ..., 'type': 'function', "
                                       "'function': {'name': ..., 'arguments': ...}}.")
            arguments = function.get("arguments")
            if isinstance(arguments, str) or arguments is None:
                try:
                    arguments = json.loads(arguments) if arguments else {}
                except ValueError as e:
                    raise ChatMessageError(f"{where}[{j}].function.arguments is not valid JSON "
                                           f"({e}).") from None
            read.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": read})
    return out
