"""The ``model`` field: served names, LoRA adapters by name, and ``/v1/models``.

A request's ``model`` is either one of the served names (the base model) or an adapter name
(``resolve_model_name`` -> ``LoRARequest``); anything else is a 404, as vLLM:
``The model `x` does not exist.`` With ``--lora-dir`` (``lora_resolvers``) a name no adapter is
registered under is first offered to the resolvers (``resolve_lora_by_name``, awaited by the routes
before they resolve the name): the adapter they find is loaded then, as by ``/v1/load_lora_adapter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from engine.core_messages import AddLoRA, RemoveLoRA
from engine.server.errors import BadRequestError, NotFoundError
from engine.server.protocol import ModelCard, ModelList
from engine.server.lora_paths import path_under_roots
from engine.server.lora_resolver import LoRAResolver
from lora.errors import LoRAAdapterError
from lora.request import LoRARequest

logger = logging.getLogger("chorus.server")


@dataclass
class LoRAModulePath:
    """One ``--lora-modules`` item: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_modules(items: Optional[list[str]]) -> list[LoRAModulePath]:
    """vLLM's LoRAParserAction: ``name=path`` when the item has '=' and no comma, else JSON."""
    modules = []
    for item in items or []:
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            modules.append(LoRAModulePath(name, path))
            continue
        try:
            obj = json.loads(item)
            modules.append(LoRAModulePath(obj["name"], obj["path"], obj.get("base_model_name")))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"--lora-modules item {item!r}: use name=path or "
                             f'{{"name": ..., "path": ..., "base_model_name": ...}} ({e}).') from e
    return modules


class OpenAIServingModels:
    """Resolves the ``model`` field and lists models; holds the adapter registry."""

    def __init__(self, engine_client: Any, served_model_names: list[str], model_path: str,
                 lora_modules: Optional[list[LoRAModulePath]] = None,
                 lora_resolvers: Optional[Sequence[LoRAResolver]] = None) -> None:
        self.engine_client = engine_client
        self.served_model_names = list(served_model_names)
        self.model_path = model_path
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}
        """Adapter name -> LoRARequest, for every adapter a request may name."""
        self.lora_resolvers: list[LoRAResolver] = list(lora_resolvers or [])
        """``--lora-dir`` (and any other resolver): adapters loaded by name on first use."""
        self._lora_id_counter = itertools.count(1)
        self._name_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        """Adapter name -> (its lock, [holders and waiters]): loads and unloads of one name run one at a time,
        those of different names at once (a burst naming many cold adapters is not read one by one)."""

    @contextlib.asynccontextmanager
    async def _name_lock(self, name: str):
        """Hold the lock of adapter ``name`` (dropped from ``_name_locks`` when nobody holds or waits)."""
        lock, users = self._name_locks.setdefault(name, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._name_locks[name]

    @property
    def model_name(self) -> str:
        """The name reported in responses for the base model (the first served name)."""
        return self.served_model_names[0]

    def is_base_model(self, name: Optional[str]) -> bool:
        return name is None or name in self.served_model_names

    def resolve_model_name(self, name: Optional[str]) -> Optional[LoRARequest]:
        """``model`` field -> None (base model) or the adapter's LoRARequest.

        Raises:
            NotFoundError: neither a served name nor a known adapter.
        """
        if self.is_base_model(name):
            return None
        lora = self.lora_requests.get(name)
        if lora is not None:
            return lora
        raise NotFoundError(f"The model `{name}` does not exist.", param="model")

    def response_model_name(self, name: Optional[str], lora: Optional[LoRARequest]) -> str:
        return lora.lora_name if lora is not None else (name if name else self.model_name)

    def show_available_models(self, resolvable: Sequence[str] = ()) -> ModelList:
        """The served names and registered adapters, then ``resolvable`` names (``list_resolvable``) that
        are neither (``/v1/models?all=true``)."""
        max_len = self.engine_client.max_model_len
        cards = [ModelCard(id=name, root=self.model_path, max_model_len=max_len)
                 for name in self.served_model_names]
        for lora in self.lora_requests.values():
            cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path,
                                   parent=lora.base_model_name or self.model_name))
        listed = {card.id for card in cards}
        for name in resolvable:
            if name not in listed:
                listed.add(name)
                cards.append(ModelCard(id=name, parent=self.model_name))
        return ModelList(data=cards)

    async def list_resolvable(self) -> list[str]:
        """Every name the resolvers know (first resolver first), listed off the event loop; nothing is
        loaded."""
        if not self.lora_resolvers:
            return []

        def names() -> list[str]:
            out: list[str] = []
            for resolver in self.lora_resolvers:
                out.extend(resolver.list_names())
            return out

        return await asyncio.to_thread(names)

    async def resolve_lora_by_name(self, name: Optional[str]) -> Optional[LoRARequest]:
        """Make ``name`` resolvable by ``resolve_model_name``: a name that is neither served nor
        registered is looked up in the resolvers (off the event loop) and its adapter loaded, as
        ``/v1/load_lora_adapter`` would, so it counts against the engine's host LRU like any other.

        Raises:
            NotFoundError: no resolver knows the name (names that would leave a resolver's directory
                included), as for any unknown model.
            BadRequestError: the directory found is not a loadable adapter (no adapter_config.json, bad
                weights, rank too large); nothing is registered, the server log says why.
        """
        if self.is_base_model(name) or not self.lora_resolvers:
            return None
        lora = self.lora_requests.get(name)
        if lora is not None:
            return lora
        path = await asyncio.to_thread(self._resolve_path, name)
        if path is None:
            raise NotFoundError(f"The model `{name}` does not exist.", param="model")
        async with self._name_lock(name):
            lora = self.lora_requests.get(name)
            if lora is not None:   # another request loaded it meanwhile
                return lora
            lora = self._new_lora_request(name, path, None)
            try:
                return await self._load(lora)
            except (LoRAAdapterError, OSError) as e:
                logger.warning("LoRA adapter %r could not be loaded from %r (--lora-dir): %s", name, path, e)
                uploads = self._adapter_uploads()
                if uploads is not None:
                    uploads.forget(name)
                raise BadRequestError(f"The LoRA adapter `{name}` could not be loaded from the server's "
                                      "adapter directory: it is not a loadable PEFT adapter. The server log "
                                      "says why." + self._tower_hint(), param="model") from None

    def _resolve_path(self, name: str) -> Optional[str]:
        for resolver in self.lora_resolvers:
            try:
                path = resolver.resolve(name)
            except (OSError, ValueError) as e:
                logger.warning("LoRA resolver %r failed for %r: %s", resolver, name, e)
                path = None
            if path is not None:
                return path
        return None

    # ------------------------------------------------------------------------------------
    # Adapters (static ones at start-up; runtime load/unload when allowed)
    # ------------------------------------------------------------------------------------
    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                base_model_name: Optional[str] = None) -> LoRARequest:
        """Load an operator's adapter (``--lora-modules``): any path; errors say what is wrong with it."""
        self._check_new_name(lora_name, lora_path)
        async with self._name_lock(lora_name):
            self._check_new_name(lora_name, lora_path)
            return await self._load(self._new_lora_request(lora_name, lora_path, base_model_name))

    async def load_runtime_lora_adapter(self, lora_name: str, lora_path: str,
                                        base_model_name: Optional[str] = None,
                                        allowed_roots: Optional[Sequence[str]] = None) -> LoRARequest:
        """Load a client's adapter (``/v1/load_lora_adapter``). ``lora_path`` is resolved (symlinks and
        ``..`` followed) and, with ``allowed_roots`` (``--allowed-lora-path``, resolved), must lie under
        one of them. Every failure to load it is one 400 (``param: lora_path``) that says nothing of
        the server's files (whether the path exists, what it holds); the server log has the reason."""
        self._check_new_name(lora_name, lora_path)
        async with self._name_lock(lora_name):
            self._check_new_name(lora_name, lora_path)
            if allowed_roots is not None:
                resolved = path_under_roots(lora_path, allowed_roots)
                if resolved is None:
                    logger.warning("LoRA adapter %r: lora_path %r is not under --allowed-lora-path; refused.",
                                   lora_name, lora_path)
                    raise self._not_loadable(lora_name, allowed_roots)
                lora_path = resolved
            lora = self._new_lora_request(lora_name, lora_path, base_model_name)
            try:
                return await self._load(lora)
            except (LoRAAdapterError, OSError) as e:
                logger.warning("LoRA adapter %r could not be loaded from %r: %s", lora_name, lora_path, e)
                raise self._not_loadable(lora_name, allowed_roots, self._tower_hint()) from None

    def _check_new_name(self, lora_name: str, lora_path: str) -> None:
        if not lora_name or not lora_path:
            raise BadRequestError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if lora_name in self.lora_requests or lora_name in self.served_model_names:
            raise BadRequestError(f"The lora adapter '{lora_name}' has already been loaded.", param="lora_name")

    def _new_lora_request(self, lora_name: str, lora_path: str, base_model_name: Optional[str]) -> LoRARequest:
        return LoRARequest(lora_name=lora_name, lora_int_id=next(self._lora_id_counter), lora_path=lora_path,
                           base_model_name=base_model_name or self.model_name)

    @staticmethod
    def _not_loadable(lora_name: str, allowed_roots: Optional[Sequence[str]], hint: str = "") -> BadRequestError:
        where = ("a PEFT adapter directory under one of the server's --allowed-lora-path directories"
                 if allowed_roots is not None else "a PEFT adapter directory the server can load")
        return BadRequestError(f"The LoRA adapter {lora_name!r} could not be loaded from lora_path: it must "
                               f"name {where}. The server log says why.{hint}", param="lora_path")

    def _tower_hint(self) -> str:
        """A sentence for a refused adapter on a server whose model has a vision tower and projector that it
        does not adapt: the same for every adapter, so it says nothing of the adapter's files."""
        uploads = self._adapter_uploads()
        if uploads is None or not uploads.refuses_tower_adapters:
            return ""
        return (" An adapter that updates the vision tower or projector needs the server started with "
                "--enable-tower-connector-lora.")

    def _adapter_uploads(self):
        """The client's ``lora.adapter_uploads.AdapterUploads`` (None: LoRA disabled)."""
        return getattr(getattr(self.engine_client, "processor", None), "adapter_uploads", None)

    async def _load(self, lora: LoRARequest) -> LoRARequest:
        """Read the adapter on a worker thread (disk, checks: never on the event loop nor in the
        engine's step loop), hand it to the engine, then let requests name it."""
        uploads = self._adapter_uploads()
        loaded = await asyncio.to_thread(uploads.read, lora) if uploads is not None else lora
        await self.engine_client.call_engine(AddLoRA(loaded, checked=uploads is not None))
        if uploads is not None:
            uploads.mark_sent(lora)
        self.lora_requests[lora.lora_name] = lora
        logger.info("Loaded LoRA adapter %r from %r.", lora.lora_name, lora.lora_path)
        return lora

    async def unload_lora_adapter(self, lora_name: str) -> None:
        async with self._name_lock(lora_name):
            lora = self.lora_requests.get(lora_name)
            if lora is None:
                raise NotFoundError(f"The lora adapter '{lora_name}' cannot be found.", param="lora_name")
            uploads = self._adapter_uploads()
            if uploads is not None:
                uploads.forget(lora_name)
            await self.engine_client.call_engine(RemoveLoRA(lora_name))
            del self.lora_requests[lora_name]
