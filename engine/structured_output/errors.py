"""The one error type of constrained decoding."""

from __future__ import annotations

from typing import Optional

PARAM_STRUCTURED_OUTPUTS = "structured_outputs"
"""The request field blamed for a bad ``structured_outputs`` (and offline ``SamplingParams``)."""
PARAM_RESPONSE_FORMAT = "response_format"
"""The request field blamed for a bad OpenAI ``response_format``."""


class StructuredOutputError(ValueError):
    """A constraint that cannot be served: malformed parameters, a schema, regex or grammar that does not
    compile (the message is the compiler's reason), a feature no backend supports, or a tokenizer the
    backends cannot read. The API layer answers it with a 400 naming ``param``."""

    def __init__(self, message: str, param: str = PARAM_STRUCTURED_OUTPUTS,
                 backend: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param
        """The request field to blame: ``structured_outputs`` or ``response_format``."""
        self.backend = backend
        """The backend whose compiler gave the reason (``xgrammar``, ``guidance``); None for errors
        found before any backend ran."""

    def __reduce__(self):
        """Pickles with ``param`` and ``backend`` (the error crosses to the API process)."""
        return (StructuredOutputError, (str(self), self.param, self.backend))

    def with_param(self, param: str) -> "StructuredOutputError":
        """The same error blaming ``param`` (a ``response_format`` read into ``structured_outputs``)."""
        return StructuredOutputError(str(self), param=param, backend=self.backend)

    def named(self) -> "StructuredOutputError":
        """The same error with its message starting with ``param`` (``"response_format: ..."``): the API
        layer reads the field a ``ValueError`` blames from the head of its message."""
        text = str(self)
        if text.startswith((f"{self.param}:", f"{self.param} ")):
            return self
        return StructuredOutputError(f"{self.param}: {text}", param=self.param, backend=self.backend)
