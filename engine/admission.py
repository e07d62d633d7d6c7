"""Admission of requests to ``AsyncLLM``: their ids and their sequences, counted against ``RequestLimits``.

A request is admitted before anything of it is processed: its id is checked against every request and
sequence in flight (an ``n > 1`` request's sequences have ids ``{request_id}#{i}``, which no client id
can equal), and its sequences are counted against ``RequestLimits.max_queued_requests`` from then until
its stream closes, preprocessing included: beyond the bound ``EngineOverloadedError`` (503 +
Retry-After), a request that could never fit a ``ValueError`` (400). A request cancelled while it is
preprocessed stays counted until its worker finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Optional

from engine.processor import sequence_ids
from engine.request_limits import EngineOverloadedError, RequestLimits


@dataclass
class Admission:
    """A request counted against ``RequestLimits`` and holding its id, from its arrival (before it is
    processed) until its stream closes, or until its worker finishes after it was cancelled."""

    request_id: str
    """The request's id (no other request or sequence in flight may take it meanwhile)."""
    sequence_ids: list[str]
    """The engine ids its sequences will have (``processor.sequence_ids``)."""
    num_seqs: int
    """Sequences it counts against ``RequestLimits.max_queued_requests``."""
    released: bool = False
    """Its sequences and ids were given back."""


class SequenceReservation:
    """Sequences reserved at once for the requests of one HTTP exchange (``AsyncLLM.reserve_sequences``);
    each ``add_request`` given it takes its ``n`` from here. ``release()`` gives back what was not taken."""

    def __init__(self, control: "AdmissionControl", num_seqs: int) -> None:
        self._control = control
        self.num_left = num_seqs
        """Sequences reserved and not yet taken by a request."""

    def take(self, num_seqs: int) -> None:
        """Move ``num_seqs`` of the reservation to one request (beyond what is left: admitted anew)."""
        from_here = min(num_seqs, self.num_left)
        if num_seqs > from_here:
            self._control.admit_sequences(num_seqs - from_here, param="n")
        self.num_left -= from_here

    def release(self) -> None:
        """Give back what no request took (idempotent)."""
        self._control.num_seqs_in_flight -= self.num_left
        self.num_left = 0


class AdmissionControl:
    """The ids and sequence counts of the requests in flight, checked against ``limits``.

    Args:
        max_num_seqs: sequences the engine runs at once (``--max-num-seqs``); ``limits`` bounds those
            waiting beyond it.
    """

    def __init__(self, max_num_seqs: int, limits: Optional[RequestLimits] = None) -> None:
        self._max_num_seqs = max_num_seqs
        self.limits = limits or RequestLimits()
        """Queue bound and request timeout (the server's from its flags; default: no bound)."""
        self._admissions: dict[str, Admission] = {}
        """Every request admitted and not yet released, by id: being processed, or with a state."""
        self._sequence_owners: dict[str, str] = {}
        """Engine sequence id -> the id of the admitted request it belongs to."""
        self.num_seqs_in_flight = 0
        """Sequences admitted (requests' and ``SequenceReservation``s') and not yet given back."""

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet released."""
        return len(self._admissions)

    def reserve(self, num_seqs: int, param: str) -> SequenceReservation:
        """Count ``num_seqs`` sequences at once for several requests that then take their share."""
        self.admit_sequences(num_seqs, param)
        return SequenceReservation(self, num_seqs)

    def admit_sequences(self, num_seqs: int, param: str) -> None:
        """Count ``num_seqs`` sequences, or raise ``ValueError`` (never fits; names ``param``) or
        ``EngineOverloadedError`` (does not fit now)."""
        max_queued = self.limits.max_queued_requests
        if max_queued is not None:
            max_running = self._max_num_seqs
            bound = max_running + max_queued
            if num_seqs > bound:
                what = "prompts x n" if param == "prompt" else "n"
                raise ValueError(
                    f"{param}: the request has {num_seqs} sequences ({what}), more than this server ever "
                    f"holds at once ({max_running} running, --max-num-seqs, + {max_queued} waiting, "
                    "--max-queued-requests); send fewer prompts or a smaller n.")
            if self.num_seqs_in_flight + num_seqs > bound:
                raise EngineOverloadedError(
                    f"The server is overloaded: {self.num_seqs_in_flight} sequences are in flight "
                    f"({max_running} run at once, {max_queued} may wait: --max-queued-requests) and this "
                    f"request has {num_seqs}; retry later.")
        self.num_seqs_in_flight += num_seqs

    def admit(self, request_id: str, n: int, reservation: Optional[SequenceReservation],
              ids_in_use: Container[str]) -> Admission:
        """Check the request's id and its sequences' ids against every request in flight (and
        ``ids_in_use``), count its ``n`` sequences (taken from ``reservation`` when given), and record it;
        nothing is written on a refusal."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}.")
        seq_ids = sequence_ids(request_id, n)
        taken = [i for i in [request_id, *seq_ids] if i in self._admissions or i in self._sequence_owners
                 or i in ids_in_use]
        if taken:
            raise ValueError(f"request_id: {request_id!r} is already in use.")
        if reservation is not None:
            reservation.take(n)
        else:
            self.admit_sequences(n, param="n")
        admission = Admission(request_id, seq_ids, n)
        self._admissions[request_id] = admission
        for seq_id in seq_ids:
            self._sequence_owners[seq_id] = request_id
        return admission

    def release(self, admission: Admission) -> None:
        """Give a request's sequences and ids back (idempotent)."""
        if admission.released:
            return
        admission.released = True
        self.num_seqs_in_flight -= admission.num_seqs
        if self._admissions.get(admission.request_id) is admission:
            del self._admissions[admission.request_id]
        for seq_id in admission.sequence_ids:
            if self._sequence_owners.get(seq_id) == admission.request_id:
                del self._sequence_owners[seq_id]
