"""``HealthPoller``: /health polled from a thread while a hostile request is served (the issue's "and
/health answered within a second meanwhile")."""

from __future__ import annotations

import threading
import time
from typing import Optional

import httpx

HEALTH_DEADLINE_S = 1.0
"""/health must answer within this while a hostile request is served."""


class HealthPoller:
    """Polls /health every ``interval_s`` while the ``with`` block runs. ``polls``: (start time
    ``time.monotonic()``, latency in seconds, status; 0 when there was no answer)."""

    def __init__(self, server, interval_s: float = 0.05) -> None:
        self.url = server.url + "/health"
        self.interval_s = interval_s
        self.polls: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    status = client.get(self.url).status_code
                except httpx.HTTPError:
                    status = 0
                self.polls.append((start, time.monotonic() - start, status))
                self._stop.wait(self.interval_s)

    def __enter__(self) -> "HealthPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(self.interval_s * 2)   # one more poll after the request
        deadline = time.monotonic() + 10
        while not self.polls and time.monotonic() < deadline:   # a quick block on a busy machine
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(15)

    def assert_answered_within(self, seconds: float = HEALTH_DEADLINE_S, min_polls: int = 1,
                               since: Optional[float] = None, until: Optional[float] = None) -> None:
        """Every poll started in [since, until] (default: all) got a 200 within ``seconds``."""
        polls = [(lat, status) for start, lat, status in self.polls
                 if (since is None or start >= since) and (until is None or start <= until)]
        assert len(polls) >= min_polls, polls
        assert all(status == 200 and lat < seconds for lat, status in polls), polls
