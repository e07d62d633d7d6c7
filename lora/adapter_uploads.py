"""``AdapterUploads``: the engine client's side of adapter registration.

A request (or ``add_lora``) that names an adapter the engine has not been sent yet carries the
adapter's weights (``LoRARequest.adapter``), read here on the client's thread; later requests naming
it carry its name only. The record of what was sent is per client and only saves reads: where it is
out of date (a request that carried the weights never reached the engine, or the engine dropped the
adapter again), the engine reads the adapter itself, off its step loop (``lora.adapter_loader``).

A client in another process than the engine (the copy an engine process's client unpickles) sends names
and paths only: it checks an adapter from its config and its weights file's header, and the engine reads the
weights itself on its loader thread. Weights sent across processes would be copied into a shared-memory
segment per tensor (448 for an adapter on the 7 projections of a 32-layer model) and mapped again on the
other side, which costs more than the engine's own read from the page cache.

What a read tells of an adapter is kept too: whether it updates the model's encoder (a vision tower or its
projector with ``--enable-tower-connector-lora``, Whisper's encoder), which decides the encoder-cache key of a
request's media (``adapts_encoder``) where the request is processed.
"""

from __future__ import annotations

import threading
from typing import Optional

from lora.adapter_reader import AdapterReader
from lora.request import LoRARequest


class AdapterUploads:
    """Which adapters this client sent to the engine, by name; thread-safe (requests are processed on
    worker threads).

    Args:
        reader: reads an adapter for the engine's base model.
    """

    def __init__(self, reader: AdapterReader, ship_weights: bool = True) -> None:
        self.reader = reader
        self.ship_weights = ship_weights
        """Requests and ``add_lora`` carry the weights read here; False: they carry names and paths, checked
        here (``AdapterReader.check``) and read by the engine."""
        self._sent: dict[str, str] = {}
        """Adapter name -> the lora_path its weights were sent from."""
        self._adapts_encoder: dict[str, tuple[str, bool]] = {}
        """Adapter name -> (the lora_path this client read it from, whether it updates an encoder
        projection: ``LoRAAdapter.adapts_encoder``)."""
        self._lock = threading.Lock()
        """Guards ``_sent`` and ``_adapts_encoder`` (reads run outside it: two first requests may both read;
        the engine keeps one)."""

    def read(self, lora_request: LoRARequest) -> LoRARequest:
        """``lora_request`` carrying its adapter, read from disk now; without ``ship_weights``, checked and
        without weights (LoRA errors as ``AdapterReader.read``)."""
        adapter = self.reader.read(lora_request) if self.ship_weights else self.reader.check(lora_request)
        with self._lock:
            self._adapts_encoder[lora_request.lora_name] = (lora_request.lora_path, adapter.adapts_encoder)
        return lora_request.with_adapter(adapter) if self.ship_weights else lora_request.without_adapter()

    def attach(self, lora_request: Optional[LoRARequest]) -> Optional[LoRARequest]:
        """What a request naming ``lora_request`` sends: it with its adapter when the engine was not
        sent that adapter (name and path) yet, recorded as sent; else it without weights."""
        if lora_request is None:
            return None
        lora_request = lora_request.without_adapter()
        if self.was_sent(lora_request):
            return lora_request
        loaded = self.read(lora_request)
        self.mark_sent(loaded)
        return loaded

    def adapts_encoder(self, lora_request: LoRARequest) -> bool:
        """Whether the adapter (name and path) updates a projection of the model's encoder, so that the
        encoder output of a request running it is its own: as this client read it. True for one it never
        read (its record was marked sent without a read): the engine reads that one, and an own encoder
        output is right either way."""
        with self._lock:
            known = self._adapts_encoder.get(lora_request.lora_name)
        return known is None or known[0] != lora_request.lora_path or known[1]

    @property
    def refuses_tower_adapters(self) -> bool:
        """The base model has a vision tower and projector adapters could update, and this engine does not
        adapt them (started without ``--enable-tower-connector-lora``): such adapters are refused."""
        return bool(self.reader.targets.tower_modules)

    def was_sent(self, lora_request: LoRARequest) -> bool:
        with self._lock:
            return self._sent.get(lora_request.lora_name) == lora_request.lora_path

    def mark_sent(self, lora_request: LoRARequest) -> None:
        with self._lock:
            self._sent[lora_request.lora_name] = lora_request.lora_path

    def forget(self, lora_name: str) -> None:
        """The engine no longer holds the adapter (unloaded, or its registration rolled back)."""
        with self._lock:
            self._sent.pop(lora_name, None)
            self._adapts_encoder.pop(lora_name, None)

    def __getstate__(self) -> dict:
        # A copy (the engine-process client's) starts with nothing sent and a lock of its own, and sends no
        # weights: it is in another process than the engine.
        return {"reader": self.reader}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["reader"], ship_weights=False)
