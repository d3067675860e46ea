"""What the scheduler half tells the worker half each engine step (``KVConnectorMetadata``).

vLLM builds one :class:`KVBlendConnectorMetadata` per step on the scheduler
(``build_connector_meta``), ships it with the ``SchedulerOutput`` to every worker (pickled when
they live in other processes) and binds it to the worker's connector for that step. It holds
loads (:class:`LoadSpec`: which tokens to produce into vLLM's paged KV, at which slots) and
stores (:class:`StoreSpec`: which segments or prefix chunks to put into the cache).

Slots are vLLM's flat paged-cache positions: token ``t`` of a request lives at
``block_ids[t // block_size] * block_size + t % block_size``
(:func:`cluster.vllm.paged.slot_mapping_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from cluster.vllm.cost_samples import CostSamples

if TYPE_CHECKING:
    import torch

    from blend.plan import BlendPlan
    from tiers.keys import ChunkKey


@dataclass
class LoadSpec:
    """Tokens ``[load_start, load_end)`` of one request to produce into vLLM's paged cache.

    ``plan`` set: blend (the engine computes ``[0, plan.blend_end)`` and only the claimed
    rows are written). ``prefix`` set: exact prefix chunks ``(key, start, end)`` to load.
    """

    request_id: str
    load_start: int
    load_end: int
    slot_mapping: torch.Tensor                  # [load_end - load_start] int64
    block_ids: list[int]
    block_size: int
    plan: BlendPlan | None = None
    prefix: list[tuple[ChunkKey, int, int]] = field(default_factory=list)
    token_ids: tuple[int, ...] = ()             # [0, load_end): for the full-prefill fallback
    load_async: bool = False                    # vLLM's async-load path (cluster.vllm.connector)


@dataclass
class StoreSpec:
    """What to store for one request: canonical chunk segments and/or prefix chunks."""

    request_id: str
    segments: list[tuple[ChunkKey, tuple[int, ...]]] = field(default_factory=list)
    prefix: list[tuple[ChunkKey, torch.Tensor]] = field(default_factory=list)  # key, slots [chunk_size]


@dataclass
class KVBlendConnectorMetadata(KVConnectorMetadata):
    """One engine step's loads and stores, and two facts about the step the worker uses to
    pace its background work (``has_prefill``, ``idle``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    has_prefill: bool = False   # this step computes prompt tokens (stores wait for a later step)
    idle: bool = False          # nothing scheduled: async loads may run to the end in this step


@dataclass
class KVBlendWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker halves tell the scheduler half each engine step (vLLM's worker metadata:
    built by ``build_connector_worker_meta``, aggregated over the workers, handed to
    ``update_connector_output``): the cost estimates' samples (:mod:`cluster.vllm.costs`)."""

    samples: CostSamples = field(default_factory=CostSamples)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVBlendWorkerMetadata:
        if isinstance(other, KVBlendWorkerMetadata):
            self.samples = self.samples.merge(other.samples)
        return self
