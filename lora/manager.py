"""``LoRAManager``: the runner-side owner of adapter weights (host store and GPU slot buffers).

Life of an adapter:

1. ``register`` (when a request names it, or ``add_lora``): keep the tensors the engine's client
   read (``lora.adapter_uploads``: off the step loop) in the host store (``max_cpu_loras`` adapters).
2. ``host_ready`` / ``take_reads``: a waiting request gets a slot only once its adapter is in the
   host store; one the store dropped is read again by the loader thread (``lora.adapter_loader``)
   while the other requests run (at most ``MAX_READS_IN_FLIGHT_FRACTION`` of the store's capacity
   queued at once, and only for the adapters the scheduler asks about first in a step: see
   ``host_ready``). The store evicts by recency and pending demand (``demand``: the scheduler's
   ``lora_demand``), so an adapter about to be admitted is not dropped for one needed later.
3. ``load_slots`` (before a step, as the scheduler's ``lora_loads`` say): copy the adapter from
   the host store into its slot of every adapted layer; projections it does not target are zeroed.
   On CUDA the copies run on a side stream from pinned memory: the step waits for them through an
   event, and a prefetch load (for a request a later step admits) is waited for by the next step
   only, so its copy overlaps this step's forward.
4. ``set_batch`` (once per step): group the step's tokens by slot; every layer reads it. Calls
   outside the step's token batch (an encoder-decoder model's encoder and cross-attention K/V
   projection, on encoder rows) run under ``rows_batch`` with one slot per row.
5. ``remove``: forget the adapter, drop its host copy and zero its slot. The engine calls it
   only once the scheduler says no request uses the adapter any more.

Decision and storage live apart: the scheduler decides which adapter sits in which slot; this
class only copies what the step message says.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.dtypes import TORCH_DTYPES
from engine.kernel_policy import KernelPolicy
from engine.layers.adapter import Feeds
from kernels.lora_pages import LoRASlotPages, padded_pages
from lora.adapter_loader import AdapterLoader
from lora.adapter_reader import AdapterReader
from lora.adapter_store import AdapterStore
from lora.adapter_uploads import AdapterUploads
from lora.batch import LoRABatchState, LoRAMetaBuffers
from lora.errors import InvalidLoRAAdapterError, LoRAAdapterError, LoRAAdapterNotFoundError
from lora.expert_layers import ExpertLoRASlots
from lora.layers import LinearLoRASlots, LoRAPending
from lora.peft_adapter import LoRAAdapter, LoRATargets
from lora.peft_adapter import max_rank_in as _max_rank_in
from lora.rank_pool import PAGE_ROWS, RankPagePool, pages_for_rank, pool_num_pages
from lora.request import LoRARequest

logger = logging.getLogger("chorus.lora")

GRAPH_FEW_ADAPTERS = 16
"""Decode CUDA graphs of a Triton LoRA engine with more slots than this get a variant for steps whose
adapters all sit in the first this-many slots (``few_adapters_bound``; the slot manager fills the
lowest free slot first): fixed-grid launches over fewer slots have fewer programs that find an
empty segment, so such steps run faster (``benchmarks/RESULTS.md``, "Launch configs and constants
inside the kernels")."""


MAX_READS_IN_FLIGHT_FRACTION = 0.5
"""``host_ready`` queues disk reads only while fewer than this fraction of ``max_cpu_loras`` are queued
(at least one): the scheduler asks in queue order, so the reads go to the adapters needed soonest, and
what they put in the store does not evict each other before their requests are admitted."""


STACKED_COVER_MIN_GAIN = 0.03
"""``tune_stacked_cover`` covers more slots than the bound only when that GEMM is at least this much
faster (a smaller difference is within the timing's spread)."""


def stacked_cover_candidates(slot_bound: int, max_loras: int) -> list[int]:
    """Slot counts the stacked GEMM of a step bounded by slot_bound may cover: the bound, then up to
    twice it (at most max_loras) in steps of a quarter of it."""
    step = max(1, slot_bound // 4)
    return list(range(slot_bound, min(max_loras, 2 * slot_bound) + 1, step))


def time_gemms_us(calls: Sequence[Callable[[], object]], reps: int = 3) -> float:
    """Device microseconds per call of ``calls`` run back to back (CUDA: one warm round, then
    ``reps`` timed rounds between events; GEMMs of decoder layers in a row, as a step runs them)."""
    for call in calls:
        call()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for call in calls:
            call()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / (reps * len(calls))


class LoRAManager:
    """Wraps the model's projections with slot buffers and moves adapters between disk, host and slots.

    Args:
        lora_config: ``engine.config.LoRAConfig`` (max_loras, max_lora_rank, max_cpu_loras, lora_dtype).
        model: the loaded base model; its q/k/v/o/gate/up/down ``Linear``s get a ``LinearLoRASlots`` as ``adapter``.
        device: where the slot buffers live.
        dtype: the model dtype (the slot dtype when ``lora_dtype`` is "auto").
        backend: "triton" or "torch"; None picks triton on CUDA, torch elsewhere.
        policy: the engine's kernel policy (the runner's); None: ``KernelPolicy.for_device(device)``.
    """

    def __init__(self, lora_config, model: nn.Module, device: torch.device, dtype: torch.dtype,
                 backend: Optional[str] = None, policy: Optional[KernelPolicy] = None) -> None:
        self.config = lora_config
        self.max_loras: int = lora_config.max_loras
        self.max_lora_rank: int = lora_config.max_lora_rank
        self.device = torch.device(device)
        self.lora_dtype = dtype if lora_config.lora_dtype == "auto" else TORCH_DTYPES[lora_config.lora_dtype]
        self.backend = backend or ("triton" if self.device.type == "cuda" else "torch")
        if self.backend == "triton" and self.lora_dtype != dtype:
            raise ValueError(f"lora_dtype={lora_config.lora_dtype} differs from the model dtype {dtype}; the "
                             "CUDA LoRA kernels need them equal: use lora_dtype='auto'.")
        self.policy = policy or KernelPolicy.for_device(self.device)
        self.targets = LoRATargets.from_model(model, tower_lora=lora_config.enable_tower_connector_lora)
        if not self.targets.slices:
            raise ValueError(f"{type(model).__name__} has no q/k/v/o/gate/up/down projections an adapter "
                             "could update; start the engine without enable_lora.")
        self.state = LoRABatchState()
        self._meta_buffers: Optional[LoRAMetaBuffers] = None
        """Static per-step meta tensors (``allocate_step_buffers``; else sized on first use)."""
        self._step_rows: Optional[int] = None
        """Rows ``allocate_step_buffers`` sized the step buffers for (None: not allocated; they grow)."""
        self._rows_meta: Optional[LoRAMetaBuffers] = None
        """Meta tensors of a ``rows_batch`` larger than the step buffers (an encoder call: eager, never in a
        CUDA graph), grown as needed; the step's stay where captured graphs read them."""
        self.layers: dict[str, Union[LinearLoRASlots, ExpertLoRASlots]] = {}
        """Our Linear (or routed-experts) module name -> its slot buffers (also attached as its ``adapter``)."""
        experts = self.targets.expert_modules
        self.row_bytes = self._row_bytes(model)
        """Device bytes of one rank row over every adapted Linear (A's input and B's outputs of each slice)."""
        self.pool_pages: Optional[int] = None
        """With ``max_lora_pool_bytes``: pages of ``PAGE_ROWS`` rank rows the Linears' adapters share by their own
        ranks (``lora.rank_pool``); None: padded slots of ``max_lora_rank``."""
        if lora_config.max_lora_pool_bytes is not None:
            self.pool_pages = pool_num_pages(lora_config.max_lora_pool_bytes, self.row_bytes, self.max_loras,
                                             self.max_lora_rank)
            max_pages = pages_for_rank(self.max_lora_rank)
            self.state.pages = LoRASlotPages(
                torch.zeros(self.max_loras, max_pages, dtype=torch.int32, device=self.device),   # [max_loras, max_pages]
                torch.zeros(self.max_loras, dtype=torch.int32, device=self.device),              # [max_loras]
                PAGE_ROWS)
            self.state.slot_rows = [None] * self.max_loras
        else:
            # The padded layout's (read-only) table, made here, eagerly: a kernel never builds one inside a
            # CUDA graph capture (where a new tensor's values would not exist before the first replay).
            self.state.pages = padded_pages(self.max_loras, self.max_lora_rank, self.device)
        for name in self.targets.module_names:
            if name in experts:        # a MoE layer's routed experts: per-expert A/B (``lora.expert_layers``)
                gate = experts[name]
                part = gate.output_range
                model.get_submodule(name).adapter = self.layers[name] = ExpertLoRASlots(
                    gate.num_experts, gate.input_size, gate.output_size if part is None else part[1] - part[0],
                    self.max_loras, self.max_lora_rank, self.lora_dtype, self.device, self.state)
                continue
            linear = model.get_submodule(name)
            slots = LinearLoRASlots(linear.input_size, linear.output_sizes, self.max_loras,
                                    self.max_lora_rank, self.lora_dtype, self.device, self.state,
                                    self.backend, self.policy, num_pages=self.pool_pages)
            linear.adapter = slots
            if slots.stacked_max_tokens > 0 and linear.weight is not None:
                slots.stack_onto(linear)            # decode steps: the shrink inside the base GEMM
            # NOTE: a quantized base (weight_q) runs its own GEMM; the shrink runs beside it.
            self.layers[name] = slots
        if self.device.type == "cuda" and any(layer.stacked_weight is not None for layer in self.layers.values()):
            # The base weights stack_onto replaced stay in torch's cache otherwise, and the KV cache
            # is sized from the driver's free memory (``ModelRunner.determine_num_blocks``).
            torch.cuda.empty_cache()
        self.store = AdapterStore(lora_config.max_cpu_loras, pin_memory=self.device.type == "cuda")
        self.reader = AdapterReader(self.targets, self.max_lora_rank, self.lora_dtype)
        """Reads adapters for this model; the engine's client gets it to read adapters off the step loop."""
        self.loader = AdapterLoader(self.reader, pin_memory=self.device.type == "cuda")
        """The engine's own reads (``host_ready``, ``register(read_later=True)``), off the step loop."""
        self._asked: set[str] = set()
        """Adapters ``host_ready`` was asked about since the last ``take_reads`` (this step)."""
        self.demand: Callable[[], Mapping[str, int]] = dict
        """Adapter name -> queue position of its first waiting request (the engine sets the scheduler's
        ``lora_demand``): host-store eviction keeps adapters waited for, the soonest longest."""
        self._copy_stream: Optional[torch.cuda.Stream] = None
        """CUDA: the side stream slot copies run on (created on first load)."""
        self._copies_fresh: Optional[torch.cuda.Event] = None
        """CUDA: prefetch copies enqueued since the last ``set_batch`` (this step's: not waited for)."""
        self._copies_due: Optional[torch.cuda.Event] = None
        """CUDA: prefetch copies of an earlier step: the next ``set_batch`` makes the step wait for them."""
        self._unverified: set[str] = set()
        """Registered from a request that carried no weights: not read yet (its requests wait)."""
        self._registered: dict[str, LoRARequest] = {}
        """Adapters users may run, by name (validated once; weights may be evicted from the store)."""
        self._removing: set[str] = set()
        """Adapters being unloaded: new requests are refused; freed once their requests finish."""
        self._in_rows_batch = False
        """``rows_batch`` is active (it refuses nesting)."""
        self._slot_names: list[Optional[str]] = [None] * self.max_loras
        """Adapter whose weights sit in each slot (None: zeroed)."""
        self.num_slot_loads = 0
        """Slot loads since start (a swap back into a slot counts again)."""
        logger.info("LoRA: %d slots of %s on %d layers (%.1f MiB), host LRU of %d adapters, %s backend",
                    self.max_loras, f"rank {self.max_lora_rank}" if self.pool_pages is None else
                    f"ranks up to {self.max_lora_rank} in a pool of {self.pool_pages * PAGE_ROWS} rank rows",
                    len(self.layers), self.slot_nbytes() / (1 << 20), self.store.capacity, self.backend)

    def _row_bytes(self, model: nn.Module) -> int:
        """Device bytes of one rank row over every adapted Linear (routed experts keep padded slots)."""
        size = torch.empty((), dtype=self.lora_dtype).element_size()
        total = 0
        for name in self.targets.module_names:
            if name in self.targets.expert_modules:
                continue
            linear = model.get_submodule(name)
            total += (len(linear.output_sizes) * linear.input_size + sum(linear.output_sizes)) * size
        return max(total, 1)

    def rank_pool(self) -> Optional[RankPagePool]:
        """A scheduler-side allocator of this pool's pages (``LoRASlotManager``); None without a pool."""
        if self.pool_pages is None:
            return None
        return RankPagePool(self.pool_pages, PAGE_ROWS, self.row_bytes)

    def adapter_rank(self, lora_request: LoRARequest) -> int:
        """The adapter's rank, which sets its pool pages (the scheduler asks once it is in host memory);
        ``max_lora_rank`` for one not held."""
        rank = self.store.rank_of(lora_request.lora_name)
        return self.max_lora_rank if rank is None else rank

    # ------------------------------------------------------------------ registry
    def register(self, lora_request: LoRARequest, keep_if_removing: bool = False, read_later: bool = False) -> bool:
        """Make an adapter known: put its weights in the host store (once per name).

        The weights are those ``lora_request.adapter`` carries (read by the engine's client); one that
        carries none is read here (tensor-parallel workers, direct callers), or with ``read_later`` by
        the loader thread (its requests wait for it: ``host_ready``; a failed read ends them,
        ``take_reads``).

        Args:
            lora_request: the adapter.
            keep_if_removing: an explicit load (``add_lora``): an adapter being unloaded is kept
                instead of refused.
            read_later: an adapter that carries no weights is read by ``loader``, not now; on a CUDA engine
                (``pin_memory``) the weights one carries are page-locked by ``loader`` too.

        Returns:
            Whether this call registered it (False: it was registered already; a second copy of its
            weights is dropped).

        Raises:
            LoRAAdapterNotFoundError: the path or its files are missing, or the adapter is being unloaded.
            InvalidLoRAAdapterError: it cannot be served (see ``lora.peft_adapter``), or the name is
                already registered with a different path.
        """
        name = lora_request.lora_name
        if name in self._removing and not keep_if_removing:
            raise LoRAAdapterNotFoundError(
                f"LoRA adapter {name!r} is being unloaded; load it again to use it.")
        known = self._registered.get(name)
        if known is not None:
            if not _same_path(known.lora_path, lora_request.lora_path):
                raise InvalidLoRAAdapterError(
                    f"LoRA adapter {name!r} is already loaded from {known.lora_path!r}; unload it (and let "
                    f"its requests finish) before loading {lora_request.lora_path!r} under the same name.")
            self._removing.discard(name)
            if lora_request.adapter is not None and name not in self.store:
                if read_later and self.loader.pin_memory:
                    self.loader.adopt(lora_request)                # pinned off the step loop
                else:
                    self.put_registered(known, lora_request.adapter)   # a fresh copy: no read needed
            return False
        if lora_request.adapter is None and read_later:
            self._registered[name] = lora_request
            self._unverified.add(name)
            self.loader.request(lora_request)
            logger.info("LoRA adapter %r registered from %s; reading it", name, lora_request.lora_path)
            return True
        if read_later and self.loader.pin_memory:
            # The client's weights, page-locked by the loader thread: the requests wait as for a read.
            self._registered[name] = lora_request.without_adapter()
            self.loader.adopt(lora_request)
            logger.info("LoRA adapter %r registered from %s; pinning it", name, lora_request.lora_path)
            return True
        adapter = lora_request.adapter if lora_request.adapter is not None else self._read(lora_request)
        self.put_registered(lora_request, adapter)
        logger.info("LoRA adapter %r registered from %s", name, lora_request.lora_path)
        return True

    def put_registered(self, lora_request: LoRARequest, adapter: LoRAAdapter,
                       demand: Optional[Mapping[str, int]] = None) -> None:
        """Hold ``adapter`` in the host store and register it under ``lora_request`` (kept without weights);
        ``demand``: the waiting requests' adapters (``self.demand()`` when None), which eviction keeps."""
        self.store.put(adapter, self.demand() if demand is None else demand)
        self._registered[lora_request.lora_name] = lora_request.without_adapter()
        self._unverified.discard(lora_request.lora_name)

    def host_ready(self, lora_request: LoRARequest) -> bool:
        """Whether the adapter's weights are in the host store, so a step may load it into a slot;
        when not, the loader is asked to read them (the scheduler asks before it gives a request a
        slot: ``Scheduler.lora_ready``).

        The scheduler asks in queue order, once per adapter and step, so the k-th adapter asked in a
        step is about the k-th needed: a read is queued only for the first ``max_cpu_loras - max_loras``
        asked, ready or not (at least half of ``max_cpu_loras``), whose weights the store keeps until
        their requests are admitted (it evicts the adapters waited for latest); a read for one further
        back would evict itself, or one needed sooner, and be read again."""
        name = lora_request.lora_name
        self._asked.add(name)
        if self.store.get(name) is not None:
            return True
        if len(self._asked) > max(1, self.store.capacity - self.max_loras, self.store.capacity // 2):
            return False
        if self.loader.num_pending < max(1, int(self.store.capacity * MAX_READS_IN_FLIGHT_FRACTION)):
            self.loader.request(self._registered.get(name, lora_request))
        return False

    def take_reads(self) -> dict[str, LoRAAdapterError]:
        """Put the adapters the loader read since the last call in the host store; returns adapter
        name -> error for the reads that failed (their waiting requests fail with it). An adapter
        registered without weights (``read_later``) whose read failed is unregistered again. A read of
        an adapter unloaded meanwhile is dropped."""
        self._asked.clear()               # the engine calls this once per step, before ``schedule()``
        errors: dict[str, LoRAAdapterError] = {}
        demand: Optional[Mapping[str, int]] = None
        for read in self.loader.take_done():
            name = read.lora_request.lora_name
            known = self._registered.get(name)
            if known is None or known.lora_path != read.lora_request.lora_path:
                continue
            if isinstance(read.result, LoRAAdapterError):
                if name in self._unverified:
                    errors[name] = read.result
                    self.remove(name)
                else:
                    errors[name] = self._reread_error(known, read.result)
                continue
            demand = self.demand() if demand is None else demand
            self.put_registered(known, read.result, demand)
        return errors

    def adapter_reads_pending(self) -> bool:
        """The loader has reads queued, running or not taken yet."""
        return self.loader.busy

    def _reread_error(self, lora_request: LoRARequest, e: LoRAAdapterError) -> LoRAAdapterError:
        name = lora_request.lora_name
        return type(e)(f"LoRA adapter {name!r} left host memory (max_cpu_loras={self.store.capacity}) "
                       f"and could not be read again from {lora_request.lora_path!r}: {e} Restore its files, "
                       "or unload it and load it again (/v1/unload_lora_adapter, /v1/load_lora_adapter).")

    def _read(self, lora_request: LoRARequest) -> LoRAAdapter:
        return self.reader.read(lora_request)

    def client_uploads(self) -> AdapterUploads:
        """A new client-side record of sent adapters that reads them with ``reader`` (for the engine's
        ``Processor``: requests carry an adapter's weights, read off the step loop, the first time)."""
        return AdapterUploads(self.reader)

    def list_loras(self) -> list[LoRARequest]:
        """Registered adapters users may run (not those being unloaded), in registration order."""
        return [r for n, r in self._registered.items() if n not in self._removing]

    def holds(self, lora_name: str) -> bool:
        """Whether any copy of the adapter remains: registry, host store or a slot."""
        return (lora_name in self._registered or lora_name in self.store
                or lora_name in self._slot_names)

    def slot_of(self, lora_name: str) -> Optional[int]:
        """The slot holding the adapter's weights, or None."""
        return self._slot_names.index(lora_name) if lora_name in self._slot_names else None

    # ------------------------------------------------------------------ removal
    def begin_remove(self, lora_name: str) -> bool:
        """Mark an adapter for unloading: new requests are refused from now on.

        Returns:
            Whether the adapter was registered.
        """
        if lora_name not in self._registered:
            return False
        self._removing.add(lora_name)
        return True

    def pending_removals(self) -> list[str]:
        return sorted(self._removing)

    def remove(self, lora_name: str) -> bool:
        """Free an adapter now: forget it, drop its host copy and zero its slot.

        NOTE: the caller makes sure no scheduled request uses it (``Scheduler.remove_lora``).

        Returns:
            Whether anything was held.
        """
        held = self.holds(lora_name)
        if self._copy_stream is not None and lora_name in self._slot_names:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)   # its copy lands first
        for slot, name in enumerate(self._slot_names):
            if name == lora_name:
                for layer in self.layers.values():
                    layer.clear_slot(slot)
                self._set_slot_pages(slot, 0, ())
                self._slot_names[slot] = None
        self.store.remove(lora_name)
        self._registered.pop(lora_name, None)
        self._removing.discard(lora_name)
        self._unverified.discard(lora_name)
        if held:
            logger.info("LoRA adapter %r removed", lora_name)
        return held

    # ------------------------------------------------------------------ per step
    def load_slots(self, loads: Sequence) -> None:
        """Copy adapters into slots, as the step's ``lora_loads`` (``LoRASlotLoad``s) say.

        On CUDA the copies run on a side stream, after everything launched before (the last step that
        read an idle slot's old adapter), from the store's pinned tensors; an event marks their end. A
        step with a load its own requests read waits for it at once; one with prefetch loads only
        (``LoRASlotLoad.prefetch``: the scheduler emits them in steps that run tokens, so ``set_batch``
        follows) leaves the wait to the next step's ``set_batch``. On CPU they are plain copies."""
        if self.device.type != "cuda":
            for load in loads:
                self.load_slot(load.lora_slot, load.lora_request, load.pages)
            return
        current = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(current)
        with torch.cuda.stream(self._copy_stream):
            for load in loads:
                self.load_slot(load.lora_slot, load.lora_request, load.pages)
        done = torch.cuda.Event()
        done.record(self._copy_stream)
        if all(load.prefetch for load in loads):
            if self._copies_fresh is not None:       # an earlier step's, whose set_batch never ran
                self._copies_due = self._copies_fresh
            self._copies_fresh = done
            return
        current.wait_event(done)                     # covers every earlier copy on the side stream
        self._copies_fresh = self._copies_due = None

    def _wait_for_prefetched(self) -> None:
        """Make the current stream wait for the prefetch copies of earlier steps; this step's become due."""
        if self._copies_due is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copies_due)
        self._copies_due, self._copies_fresh = self._copies_fresh, None

    def load_slot(self, lora_slot: int, lora_request: LoRARequest, pages: Sequence[int] = ()) -> None:
        """Copy one adapter into ``lora_slot`` of every adapted layer (zeroing untargeted slices); with a
        pool, into ``pages`` (the scheduler's ``LoRASlotLoad.pages``), the slot's rank set to the adapter's."""
        if not 0 <= lora_slot < self.max_loras:
            raise RuntimeError(f"LoRA slot {lora_slot} out of range [0, {self.max_loras}).")
        adapter = self.host_copy(lora_request)
        for slot, name in enumerate(self._slot_names):
            if name == adapter.name and slot != lora_slot:
                self._set_slot_pages(slot, 0, ())   # moved: the old copy is stale (its pages freed)
                self._slot_names[slot] = None
        if self.pool_pages is not None:
            if len(pages) < pages_for_rank(adapter.rank):
                raise RuntimeError(f"LoRA slot load of {adapter.name!r} (rank {adapter.rank}) got {len(pages)} "
                                   f"pages of {PAGE_ROWS} rows.")
            self._set_slot_pages(lora_slot, adapter.rank, pages)
        for module_name, layer in self.layers.items():
            for s in range(layer.num_slices):
                layer.set_slice(lora_slot, s, adapter.weights.get((module_name, s)))
        self._slot_names[lora_slot] = adapter.name
        self.num_slot_loads += 1

    def _set_slot_pages(self, lora_slot: int, rank: int, pages: Sequence[int]) -> None:
        """With a pool: slot ``lora_slot`` reads ``rank`` rows of ``pages`` (rank 0: nothing)."""
        table = self.state.pages
        if self.pool_pages is None:
            return
        table.slot_ranks[lora_slot].fill_(rank)
        if not rank:
            self.state.slot_rows[lora_slot] = None
            return
        # NOTE: from pinned memory on CUDA, so that the copies queue on the copy stream without the host
        # waiting for the step before (the pinned blocks are kept until their copies are done).
        cuda = self.device.type == "cuda"
        page_ids = torch.tensor(list(pages), dtype=torch.int32, pin_memory=cuda)          # [num_pages]
        rows = torch.tensor([p * PAGE_ROWS + i for p in pages for i in range(PAGE_ROWS)][:rank],
                            dtype=torch.int64, pin_memory=cuda)                          # [rank]
        table.page_table[lora_slot, :len(pages)].copy_(page_ids, non_blocking=cuda)
        self.state.slot_rows[lora_slot] = rows.to(self.device, non_blocking=cuda)

    def host_copy(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter from the host store, read again from disk if the LRU dropped it.

        ``load_slot`` calls it for each of a step's slot loads. The engine's scheduler loads only
        adapters in the host store (``host_ready``), and nothing enters or leaves the store between
        ``schedule()`` and the step's slot loads, so on the engine's rank this never reads (an adapter
        the LRU dropped is read by the loader while its requests wait, and a failed read fails them
        alone, 4xx: ``take_reads``); a tensor-parallel worker, whose store evicts on its own, may read
        here, and a failure then fails the step.

        Raises:
            LoRAAdapterNotFoundError: its directory or files are gone.
            InvalidLoRAAdapterError: its files no longer hold a servable adapter (corrupt, changed).
        """
        name = lora_request.lora_name
        adapter = self.store.get(name)
        if adapter is not None:
            return adapter
        req = self._registered.get(name, lora_request)
        try:
            adapter = self._read(req)
        except LoRAAdapterError as e:
            raise self._reread_error(req, e) from e
        self.store.put(adapter)
        self._registered.setdefault(name, req)
        return adapter

    def allocate_step_buffers(self, max_num_tokens: int) -> None:
        """Size the per-step meta tensors and the shrink scratch for the largest step, once.

        NOTE: decode CUDA graphs read these tensors' addresses; nothing reallocates them later.
        """
        self._meta_buffers = LoRAMetaBuffers(max_num_tokens, self.max_loras, self.device)
        self._step_rows = max_num_tokens
        max_slices = max(layer.num_slices for layer in self.layers.values())
        self.state.reserve(max_slices, max_num_tokens, self.max_lora_rank, self.device)

    def warm_up_kernels(self, min_tokens: int, max_tokens: int,
                        qkv_consumer: Optional[Callable[[LoRAPending, torch.Tensor], None]] = None) -> int:
        """Compile the Triton LoRA kernels for eager steps of min_tokens..max_tokens tokens now
        (start-up), not in the first steps that need them; returns the number of layer calls made
        (0 on the torch backend).

        The launch configs depend on a step's token and adapter counts
        (``LinearLoRASlots.launch_key``), and Triton compiles each new one when first launched, on
        that step's critical path. Keys are collected over a grid (every 32 tokens, plus every
        count up to 64, x 1..max_loras adapters in ~12 steps: on a Llama-3-8B shape with 64 slots it
        finds all 19 distinct keys of 2049..16384 tokens), and each runs once, on zero inputs with
        the slots cycling over that many adapters (the slot buffers are zero: nothing changes),
        with the consumer fusions eager steps take (gate/up: SiLU-and-mul; o/down: add + RMSNorm,
        per-row at decode sizes, also over the stacked GEMM's output, segment tiles at long prefill
        steps; q/k/v: rotary + KV write, through ``qkv_consumer(pending, qkv)``, the model's
        ``lora_qkv_warmup_consumer()`` (its rotary tables and KV cache); without it that fusion
        compiles on the first decode step that takes it).
        """
        if self.backend != "triton" or not self.layers or max_tokens < min_tokens:
            return 0
        token_counts = sorted({t for t in range(min_tokens, max_tokens + 1, 32)} | {max_tokens}
                              | {t for t in range(min_tokens, min(max_tokens, 64) + 1)})
        actives = sorted({a for a in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, self.max_loras)
                          if a <= self.max_loras})
        # Layers of one shape share their launch keys (the overrides and fusion switches come from
        # the engine's one KernelPolicy): one layer per shape is enough, not every decoder layer's.
        # (The routed experts' update runs inside the fused MoE kernels, compiled with the model's.)
        by_shape = {(layer.input_size, tuple(layer.output_sizes)): layer for layer in self.layers.values()
                    if isinstance(layer, LinearLoRASlots)}
        seen, calls = set(), 0
        for shape, layer in by_shape.items():
            for t in token_counts:
                for a in (a for a in actives if a <= t):
                    key = (shape, layer.launch_key(t, a))
                    if key in seen:
                        continue
                    seen.add(key)
                    self.state.batch = self._meta_for(t).fill(np.arange(t, dtype=np.int32) % a, False,
                                                              with_segments=False)
                    x = torch.zeros(t, layer.input_size, dtype=layer.lora_a.dtype, device=self.device)
                    y = torch.zeros(t, sum(layer.output_sizes), dtype=x.dtype, device=self.device)
                    if layer.takes_stacked(t):       # decode-sized steps: the shrink inside the GEMM
                        base = layer.stacked_weight[:y.shape[1]]
                        y_base, pending = layer.begin_stacked(x, base)
                        layer.finish(pending, y_base)
                        if layer.defers(t, Feeds.ADD_RMS_NORM):   # o/down: the update inside add + RMSNorm
                            y_base, pending = layer.begin_stacked(x, base)
                            norm_weight = torch.ones(y.shape[1], dtype=y.dtype, device=y.device)
                            layer.finish_add_rms_norm(pending, y_base, norm_weight, 1e-5,
                                                      torch.zeros_like(y))
                        if layer.fuse_silu_mul:
                            y_base, pending = layer.begin_stacked(x, base)
                            layer.finish_silu_mul(pending, y_base)
                        if qkv_consumer is not None and layer.defers(t, Feeds.ROTARY_KV_WRITE):
                            qkv, pending = layer.begin_stacked(x, base)   # q/k/v: inside rotary + KV write
                            qkv_consumer(pending, qkv)
                        calls += 1
                        continue
                    layer(x, y)
                    if layer.fuse_silu_mul:          # the MLP's path: the update inside SiLU-and-mul
                        layer.finish_silu_mul(layer.begin(x), y)
                    elif layer.defers(t, Feeds.ADD_RMS_NORM):   # o/down: the update inside add + RMSNorm
                        pending = layer.begin(x)
                        # NOTE: without a split plan (overlap off) the engine finishes the update
                        # before the norm: nothing more to compile.
                        if pending.plan is not None:
                            norm_weight = torch.ones(y.shape[1], dtype=y.dtype, device=y.device)
                            layer.finish_add_rms_norm(pending, y, norm_weight, 1e-5, torch.zeros_like(y))
                    elif qkv_consumer is not None and layer.defers(t, Feeds.ROTARY_KV_WRITE):
                        pending = layer.begin(x)     # q/k/v: the update inside rotary + KV write
                        if pending.plan is not None:
                            qkv_consumer(pending, y)
                    calls += 1
        self.state.batch = None
        return calls

    @torch.inference_mode()
    def tune_stacked_cover(self, token_counts: Sequence[int], slot_bound: int,
                           timer: Callable[[Sequence[Callable[[], object]]], float] = time_gemms_us
                           ) -> dict[tuple, int]:
        """Choose how many slots the stacked decode GEMM covers for steps bounded by ``slot_bound``
        (the few-adapters CUDA graphs'), per projection shape and step size: each candidate
        (``stacked_cover_candidates``) is timed over every layer of that shape, and one covering
        more slots than the bound is kept (``LinearLoRASlots.stacked_cover``) where it is at least
        STACKED_COVER_MIN_GAIN faster than the bound (each of the two timed twice, the faster sample
        kept). The extra rows' shrink is computed and never read.

        Why: cuBLAS picks its kernel by shape, so a GEMM covering a few more slots than the bound
        can be faster than the bound's own. On an H200 (Llama-3-8B, 64 tokens, rank 16,
        ``benchmarks/sweeps/stacked_gemm_sweep.py``) that held for o_proj and down_proj, and the
        wider o_proj came close to the base rows alone (``benchmarks/RESULTS.md``,
        ``lora_stacked_tune``).

        Args:
            token_counts: the step sizes (decode graph batch sizes); those that do not take the
                stacked GEMM are skipped.
            slot_bound: the steps' slot bound (< max_loras, else there is nothing to choose).
            timer: microseconds per call of a list of calls (``time_gemms_us``; tests pass a fake).

        Returns:
            {((input_size, output_sizes), num_tokens): slots covered} for every case measured.
        """
        chosen: dict[tuple, int] = {}
        if self.backend != "triton" or not 0 < slot_bound < self.max_loras:
            return chosen
        by_shape: dict[tuple, list[LinearLoRASlots]] = {}
        for layer in self.layers.values():
            if layer.stacked_weight is not None:
                by_shape.setdefault((layer.input_size, tuple(layer.output_sizes)), []).append(layer)
        cands = stacked_cover_candidates(slot_bound, self.max_loras)
        for shape, layers in by_shape.items():
            lead = layers[0]
            out, rows_per_slot = sum(lead.output_sizes), lead.num_slices * lead.max_rank
            for t in token_counts:
                if not lead.takes_stacked(t):
                    continue
                gen = torch.Generator(self.device).manual_seed(t)    # the global RNG stays untouched
                x = torch.randn(t, lead.input_size, dtype=lead.stacked_weight.dtype, device=self.device,
                                generator=gen)

                def gemms(cover: int) -> list[Callable[[], object]]:
                    cols = out + cover * rows_per_slot
                    return [lambda w=layer.stacked_weight[:cols], b=layer.stacked_bias: F.linear(
                        x, w, None if b is None else b[:cols]) for layer in layers]

                times = {c: timer(gemms(c)) for c in cands}
                best = min(times, key=times.get)
                if best != slot_bound:             # a second look at both: the faster of two samples each
                    for c in (slot_bound, best):
                        times[c] = min(times[c], timer(gemms(c)))
                if times[best] > (1 - STACKED_COVER_MIN_GAIN) * times[slot_bound]:
                    best = slot_bound
                for layer in layers:
                    if best == slot_bound:
                        layer.stacked_cover.pop((t, slot_bound), None)
                    else:
                        layer.stacked_cover[(t, slot_bound)] = best
                chosen[(shape, t)] = best
        return chosen

    def set_batch(self, token_lora_slots, fixed_grid: bool = False, max_active: Optional[int] = None) -> None:
        """Group this step's tokens by slot (once; every layer reads the result).

        Args:
            token_lora_slots: [num_tokens] slot per token, NO_LORA (-1) for base-model (and graph
                padding) tokens: a host numpy array (the runner's; no device work, no sync) or a
                tensor (copied to the host first).
            fixed_grid: launch over every slot whatever the batch (decode CUDA graphs: the grid
                captured must fit every later step); the kernels then always run.
            max_active: with fixed_grid, the most adapters the step may run (a graph captured for
                few adapters, see ``few_adapters_bound``); None: max_loras.
        """
        if self._copies_due is not None or self._copies_fresh is not None:
            self._wait_for_prefetched()
        if token_lora_slots is None or (not fixed_grid and all(n is None for n in self._slot_names)):
            self.state.batch = None   # no adapter resident: nothing to add, no grouping, no sync
            return
        if isinstance(token_lora_slots, torch.Tensor):
            token_lora_slots = token_lora_slots.cpu().numpy()
        self.state.batch = self._meta_for(len(token_lora_slots)).fill(
            np.asarray(token_lora_slots), fixed_grid, with_segments=self.backend == "torch", max_active=max_active)

    @contextmanager
    def rows_batch(self, row_lora_slots: Optional[np.ndarray],
                   item_rows: Optional[np.ndarray] = None) -> Iterator[None]:
        """The LoRA batch of a model call outside the step's token batch (an encoder-decoder model's
        encoder or cross-attention K/V projection, a vision tower, on encoder rows): ``set_batch(row_lora_slots)``
        for the call, and no batch after it (the step sets its own before its forward).

        row_lora_slots: [num_rows] host int32 slot per row the call's adapted Linears see (NO_LORA:
        the base model); None or all NO_LORA: nothing is added. At most the rows
        ``allocate_step_buffers`` sized for. NOTE: refuses nesting; the meta buffers hold one batch.
        item_rows: [num_items] the rows of each media item in ``row_lora_slots`` (consecutive), for a call
        whose Linears see other row counts (a vision tower's patches, then its merged tokens): a Linear
        of R rows gets each item's slot on R * item_rows[i] / num_rows consecutive rows (every stage of
        the call keeps the items in order, in the same proportions).
        """
        if self._in_rows_batch:
            raise RuntimeError("LoRAManager.rows_batch does not nest.")
        self._in_rows_batch = True
        self.state.spill = True        # eager rows: a scratch beyond the reserve is theirs alone
        try:
            if row_lora_slots is None or not (np.asarray(row_lora_slots) >= 0).any():
                self.state.batch = None
            else:
                self.set_batch(np.asarray(row_lora_slots, dtype=np.int32))
                if item_rows is not None:
                    self.state.regroup = self._item_regroup(np.asarray(row_lora_slots, dtype=np.int32),
                                                            np.asarray(item_rows, dtype=np.int64))
            yield
        finally:
            self.state.batch = None
            self.state.regroup = None
            self.state.spill = False
            self._in_rows_batch = False

    def _item_regroup(self, row_lora_slots: np.ndarray, item_rows: np.ndarray) -> Callable[[int], None]:
        """``LoRABatchState.regroup`` for ``rows_batch``'s media items: sets the batch of a Linear call of
        num_rows rows, each item's share of them in its slot."""
        item_slots = row_lora_slots[np.cumsum(item_rows) - item_rows]          # [num_items]
        total = int(item_rows.sum())

        def regroup(num_rows: int) -> None:
            rows = item_rows * num_rows
            if (rows % total).any():
                raise RuntimeError(f"an encoder call of {len(item_rows)} media items ({item_rows.tolist()} rows) "
                                   f"ran a Linear on {num_rows} rows, which do not split among them in proportion")
            self.set_batch(np.repeat(item_slots, rows // total))
        return regroup

    def few_adapters_bound(self, num_tokens: int) -> Optional[int]:
        """The adapter count of the CUDA-graph variant for steps of few adapters (None: no such
        variant): its fixed-grid launches cover GRAPH_FEW_ADAPTERS segments instead of max_loras,
        so fewer of their programs find an empty segment. Decode steps only (num_tokens is the
        decode batch), on the Triton backend, when max_loras is larger than the bound."""
        if self.backend != "triton" or self.max_loras <= GRAPH_FEW_ADAPTERS:
            return None
        return GRAPH_FEW_ADAPTERS

    def _meta_for(self, num_tokens: int) -> LoRAMetaBuffers:
        """The meta buffers, fit for a step of num_tokens tokens; a ``rows_batch`` of more rows than the step
        buffers hold (a vision tower's patches) gets ``_rows_meta``, so the step buffers never move."""
        if self._in_rows_batch and self._step_rows is not None and num_tokens > self._step_rows:
            if self._rows_meta is None or self._rows_meta.max_num_tokens < num_tokens:
                self._rows_meta = LoRAMetaBuffers(num_tokens, self.max_loras, self.device)
            return self._rows_meta
        if self._meta_buffers is None or self._meta_buffers.max_num_tokens < num_tokens:
            # Outside the engine (tests, tools): sized on first use, grown as needed.
            self._meta_buffers = LoRAMetaBuffers(max(num_tokens, 1), self.max_loras, self.device)
        return self._meta_buffers

    # ------------------------------------------------------------------ sizes
    def slot_nbytes(self) -> int:
        """Device bytes of every slot buffer."""
        return sum(b.numel() * b.element_size() for layer in self.layers.values() for b in layer.buffers())

    @staticmethod
    def max_rank_in(paths: Sequence[str], at_least: int = 16) -> int:
        """Largest rank among the adapters in ``paths`` and at least ``at_least``: the default
        ``max_lora_rank`` when adapters are given at start-up."""
        return _max_rank_in(list(paths), at_least)


def _same_path(a: str, b: str) -> bool:
    if a == b:
        return True   # the common case (every request of a known adapter): no filesystem calls
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return a == b
