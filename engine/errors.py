"""Errors of the engine as a service: the API layer maps them to HTTP statuses.

``EngineDeadError`` -> 503 and a failed ``/health``; ``EngineStepError`` -> 500 for the requests of a
step that raised; ``EngineStartupError`` stops ``chorus serve`` before it listens. User errors stay
``ValueError`` (400), raised by the processor.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed, killed or shut down); no request can be served."""


class EngineStartupError(RuntimeError):
    """The engine could not be built (bad checkpoint, out of memory, ...); the message says why."""


class EngineStepError(RuntimeError):
    """A step raised (in the model runner, the scheduler update, ...): the requests it ran end with
    this error (HTTP 500; offline, the ``error`` of their final ``RequestOutput``). The message says
    whether the engine recovered or is stopping."""
