"""Tool-call ids: OpenAI's form (``call_`` + 24 letters and digits) and Mistral's (9 letters and digits,
which Mistral chat templates require of every ``tool_call_id`` in the conversation)."""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable

IdFactory = Callable[[], str]
"""Makes the id of a new tool call."""
_ALNUM = string.ascii_letters + string.digits
OPENAI_ID_PREFIX = "call_"
OPENAI_ID_CHARS = 24
"""Random characters after ``call_``."""
MISTRAL_ID_CHARS = 9


def _random_alnum(n: int) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(n))


def openai_tool_call_id() -> str:
    """``call_`` + 24 random letters and digits."""
    return OPENAI_ID_PREFIX + _random_alnum(OPENAI_ID_CHARS)


def mistral_tool_call_id() -> str:
    """9 random letters and digits (Mistral's templates refuse other ids)."""
    return _random_alnum(MISTRAL_ID_CHARS)


def counting_ids(prefix: str = "call_") -> IdFactory:
    """Deterministic ids ``prefix0``, ``prefix1``, ...: for tests and reproducible logs."""
    count = iter(range(1 << 62))
    return lambda: f"{prefix}{next(count)}"
