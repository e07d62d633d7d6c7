"""Load the tokenizer of a resolved model, with an optional chat-template override."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from engine.chat_template import check_template_syntax
from engine.loader.resolve import ResolvedModel

# Characters a Jinja template has and a file path practically never does.
_TEMPLATE_MARKERS = ("{", "}", "\n")


def load_tokenizer(resolved: ResolvedModel, chat_template: Optional[str] = None,
                   trust_remote_code: bool = False):
    """Load the tokenizer of ``resolved`` (its ``tokenizer_path`` if set).

    A faster-whisper directory's comes from its tokenizer.json + vocabulary (``engine.loader.ct2.load_ct2_tokenizer``).
    A GGUF model's tokenizer comes from its converted cache directory (built on first use by
    ``gguf_loader.ensure_converted`` with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``).

    Args:
        resolved: the model from ``resolve_model``.
        chat_template: a template file path or the template text (the operator's ``--chat-template``;
            never a request's); replaces the tokenizer's own. Checked to compile here.
        trust_remote_code: passed to ``AutoTokenizer.from_pretrained``.

    Returns:
        A ``transformers.PreTrainedTokenizerBase``.
    """
    from transformers import AutoTokenizer

    if resolved.tokenizer_path is None and resolved.kind == "ct2":
        from engine.loader.ct2 import load_ct2_tokenizer

        tokenizer = load_ct2_tokenizer(resolved.path)
        if chat_template is not None:
            tokenizer.chat_template = read_chat_template(chat_template)
        return tokenizer
    if resolved.tokenizer_path is not None:
        tok_dir = resolved.tokenizer_path
    elif resolved.kind == "gguf":
        from engine.loader.gguf_loader import ensure_converted

        tok_dir = ensure_converted(resolved.path)
    else:
        tok_dir = resolved.path
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(chat_template: str) -> str:
    """Return the template text of ``chat_template``: the contents of a file path, or the text itself.

    Only for the operator's template (``--chat-template``, ``LLM(chat_template=...)``): a request's
    ``chat_template`` is always template text and never reaches here.

    Raises:
        ValueError: it looks like a file path (no braces, one line) but no such file exists, or the
            template does not compile (``engine.chat_template.check_template_syntax``).
    """
    text = _template_text(chat_template)
    try:
        check_template_syntax(text)
    except ValueError as e:
        raise ValueError(f"chat_template (--chat-template): {e} Fix the template.") from e
    return text


def _template_text(chat_template: str) -> str:
    path = Path(chat_template).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass  # too long or odd for a file name: it is the template text
    if any(marker in chat_template for marker in _TEMPLATE_MARKERS):
        return chat_template
    raise ValueError(
        f"chat_template={chat_template!r} is neither an existing file nor Jinja template text; set "
        f"`chat_template` (--chat-template) to a template file path or the template itself.")
