"""What the media being loaded may cost the server at once: decoded pixels and encoded bytes in flight.

One ``MediaBudget`` per engine client, shared by the threads that load media. A request reserves its
images' encoded bytes as they arrive and their pixels (read from each header) before any image is
decoded; what does not fit now is ``MediaBusyError`` (the server answers 503 with Retry-After), and the
reservation is released when the request's media are preprocessed (or it fails).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from multimodal.media import MediaError


class MediaBusyError(RuntimeError):
    """The media of requests in flight already take the server's budget: nothing of this request's media
    was decoded, retry later (HTTP 503 with Retry-After)."""


class MediaBudget:
    """Thread-safe counters of the pixels being decoded and the encoded media bytes held, with bounds.

    Args:
        max_pixels: decoded image pixels all requests may have in flight at once.
        max_bytes: encoded media bytes all requests may hold at once.
    """

    def __init__(self, max_pixels: int, max_bytes: int) -> None:
        self.max_pixels = max_pixels
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._num_pixels = 0
        self._num_bytes = 0

    def __getstate__(self) -> dict:
        """Pickled (an engine process sends its processor to the API process): without the lock."""
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def num_pixels(self) -> int:
        """Pixels reserved now (0 when no media is being loaded)."""
        return self._num_pixels

    @property
    def num_bytes(self) -> int:
        """Encoded bytes reserved now (0 when no media is being loaded)."""
        return self._num_bytes

    def reservation(self) -> "MediaReservation":
        """An empty reservation; ``release()`` it when the request's media are done with."""
        return MediaReservation(self)

    def _take(self, num_pixels: int, num_bytes: int) -> None:
        with self._lock:
            if self._num_pixels + num_pixels > self.max_pixels:
                raise MediaBusyError(
                    f"The server is decoding {self._num_pixels} image pixels for other requests; this request's "
                    f"{num_pixels} more would pass the limit of {self.max_pixels} "
                    "(--max-image-pixels-in-flight); retry later.")
            if self._num_bytes + num_bytes > self.max_bytes:
                raise MediaBusyError(
                    f"The server holds {self._num_bytes} bytes of media for other requests; {num_bytes} more "
                    f"would pass the limit of {self.max_bytes} (--max-media-bytes-in-flight); retry later.")
            self._num_pixels += num_pixels
            self._num_bytes += num_bytes

    def _give_back(self, num_pixels: int, num_bytes: int) -> None:
        with self._lock:
            self._num_pixels -= num_pixels
            self._num_bytes -= num_bytes


@dataclass
class MediaReservation:
    """One request's share of a ``MediaBudget``; grows as its media arrive, released once."""

    budget: MediaBudget
    """The server's budget this share is taken from."""
    num_pixels: int = 0
    """Decoded pixels reserved for this request."""
    num_bytes: int = 0
    """Encoded media bytes reserved for this request."""
    released: bool = field(default=False)
    """``release()`` ran: nothing is held any more."""

    def add(self, num_pixels: int = 0, num_bytes: int = 0) -> None:
        """Reserve more, or raise ``MediaBusyError`` (nothing more is reserved then); ``MediaError`` when
        this request alone needs more bytes than the whole budget (it could never fit)."""
        if self.num_bytes + num_bytes > self.budget.max_bytes:
            raise MediaError(f"the request's media are {self.num_bytes + num_bytes} bytes or more, above the "
                             f"server's limit of {self.budget.max_bytes} (--max-media-bytes-in-flight); send "
                             "fewer or smaller files")
        self.budget._take(num_pixels, num_bytes)
        self.num_pixels += num_pixels
        self.num_bytes += num_bytes

    def release(self) -> None:
        """Give everything back (idempotent)."""
        if not self.released:
            self.released = True
            self.budget._give_back(self.num_pixels, self.num_bytes)
