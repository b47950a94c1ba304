"""A layer's device expert cache: slots on the device beside the plan's resident experts.

``expert_cache.LayerCache`` decides which experts hold the slots; this module moves their bytes.
The slots are stacks of the layer's CPU experts' scheme (``device.DeviceExperts``, ``slots``
experts each), allocated once at load, so the device holds exactly ``slots`` experts' bytes more
than the plan's residents, whatever the routing does. A use of an expert whose slot holds it
runs on the device; any other use runs on the CPU for this token, and an expert the policy
admits is copied into its slot by one worker thread (from the bundle's mapped bytes through a
page-locked staging buffer on a side stream on CUDA; a plain copy on torch's CPU device) while
the model goes on. A slot is read only after its copy has completed (``poll``), and a slot is
written only when the policy has evicted its expert, which it never does to an expert this token
uses; on CUDA the side stream also waits for the work the compute stream has queued, which may
still read the evicted expert.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ktc.formats.bundle import Bundle

from .device import DeviceExperts
from .expert_cache import LayerCache


class DeviceSlots:
    """``slots`` device slots for the experts ``candidates`` of MoE layer ``layer`` (all of one
    scheme, ``scheme``), filled from ``bundle``. ``resident``: the plan's device experts (always
    on the device; they take no slot). ``prior``: the profile's use counts of the layer's experts
    (the policy's prior; uniform when None). Counters are the policy's (``counters``)."""

    def __init__(self, bundle: Bundle, layer: int, num_experts: int, candidates: list[int], scheme: str,
                 slots: int, device: Any, *, resident: tuple[int, ...] = (), prior: np.ndarray | None = None) -> None:
        import torch

        self.layer = layer
        self.device = torch.device(device)
        prefix = f"layers.{layer}.experts."
        self._names = {e: f"{prefix}{e}." for e in candidates}
        first = self._names[candidates[0]]
        biases = first + "gate_up_bias" in bundle.tensors
        parts = ["gate_up", "down"] + (["gate_up_bias", "down_bias"] if biases else [])
        self._bundle = bundle
        self._parts = parts
        slots = min(slots, len(candidates))  # a slot more than the candidates would stay empty
        host = [self._host(candidates[0], part) for part in parts]
        self.weights = DeviceExperts(scheme, *(torch.empty((slots, *h.shape), dtype=h.dtype, device=self.device)
                                               for h in host))
        expert_bytes = sum(h.nbytes for h in host)
        self.policy = LayerCache(num_experts, slots, expert_bytes, resident=resident, prior=prior,
                                 eligible=tuple(candidates))
        self.slot_of: dict[int, int] = {}
        self._free = list(range(slots))[::-1]
        self._pending: dict[int, Future] = {}  # expert -> its copy in flight
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._staging = ([torch.empty(h.shape, dtype=h.dtype).pin_memory() for h in host] if self._cuda else None)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ktc-cache-{layer}")
        for e in list(self.policy.pool):
            slot = self._free.pop()
            self.slot_of[e] = slot
            self._copy(e, slot)
            self.policy.uploaded(e, 0.0)

    @property
    def nbytes(self) -> int:
        """The slots' bytes on the device."""
        return self.weights.nbytes

    @property
    def counters(self) -> Any:
        return self.policy.counters

    def _host(self, expert: int, part: str) -> Any:
        import torch

        name = self._names[expert] + part
        if part.endswith("_bias"):
            return torch.from_numpy(np.ascontiguousarray(self._bundle.tensor_float32(name)))
        t = self._bundle.tensors[name]
        return torch.from_numpy(self._bundle.tensor(name).view(np.uint8).reshape(t.shape[0], -1))

    def _copy(self, expert: int, slot: int) -> None:
        """Copy ``expert``'s bytes into ``slot`` (the worker thread; at load, the caller's)."""
        import torch

        stacks = [getattr(self.weights, part) for part in self._parts]
        if not self._cuda:
            for stack, part in zip(stacks, self._parts):
                stack[slot].copy_(self._host(expert, part))
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # queued reads of the evicted expert
        for stack, staging, part in zip(stacks, self._staging, self._parts):
            staging.copy_(self._host(expert, part))  # pageable map -> page-locked
            with torch.cuda.stream(stream):
                stack[slot].copy_(staging, non_blocking=True)
            stream.synchronize()  # the staging buffer is reused by the next part

    def poll(self) -> None:
        """Tell the policy of the copies that have completed (errors in a copy are raised here)."""
        for e, future in list(self._pending.items()):
            if future.done():
                del self._pending[e]
                future.result()
                self.policy.uploaded(e, 0.0)

    def wait(self) -> None:
        """Block until every copy in flight has completed, then ``poll`` (for tests and close)."""
        for future in list(self._pending.values()):
            future.exception()
        self.poll()

    def step(self, experts: np.ndarray) -> frozenset[int]:
        """One forward's distinct ``experts``: the ones to run from a slot (the residents run from
        the plan's stacks); the policy's admissions start copying. Never waits for a copy."""
        self.poll()
        hits, _ = self.policy.step(experts, at=0.0)
        self._start(self.policy.started)
        return frozenset(e for e in hits if e in self.slot_of)

    def prefetch(self, experts: np.ndarray) -> None:
        """A guess at the next forward's experts (pre-gating, a layer ahead): the policy admits
        them as it would that forward's misses, and their copies start now."""
        self.poll()
        self._start(self.policy.prefetch(experts))

    def _start(self, started: list[tuple[int, int | None]]) -> None:
        for e, victim in started:
            if victim is not None:
                self._pending.pop(victim, None)  # superseded: the slot's next copy is e's
                slot = self.slot_of.pop(victim)
            else:
                slot = self._free.pop()
            self.slot_of[e] = slot
            self._pending[e] = self._worker.submit(self._copy, e, slot)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._pending.clear()
        self.slot_of.clear()

