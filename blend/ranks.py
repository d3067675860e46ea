"""The blend engine's collectives over a tensor-parallel group (issue 10): every rank blends its
own KV heads, so the per-token scores of a check layer are summed over the group before top-k
(every rank selects the same rows), and a layer one rank cannot read sends every rank to full
prefill together (their collectives would no longer match otherwise).

:class:`RankGroup` is what :class:`blend.engine.BlendEngine` holds; without a group both
operations are the identity, and no collective runs.
"""

from __future__ import annotations

import torch


class RankGroup:
    """Collectives of one engine over ``process_group`` (None: no tensor parallelism).

    Args:
        process_group: the tensor-parallel group, or None.
        device: the model's device; flags go through it on NCCL, through the CPU otherwise.
    """

    def __init__(self, process_group: torch.distributed.ProcessGroup | None, device: torch.device) -> None:
        self.group = process_group
        self._flag_device = torch.device("cpu")
        if process_group is not None and torch.distributed.get_backend(process_group) == "nccl":
            self._flag_device = device

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks (in place; ``x`` itself without a group)."""
        if self.group is not None:
            torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return x

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank read its layer. One tiny ``all_reduce`` per layer above the first
        check layer; on NCCL its ``int()`` waits for the device (not yet measured: no two-GPU
        machine, issue 10)."""
        if self.group is None:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=self._flag_device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(flag) == 0
