"""Triton kernels of the blend hot path, each beside its plain-torch reference.

:mod:`blend.kernels.rope` re-rotates cached K in place, :mod:`blend.kernels.deviation` scores
the per-token K (or V) deviation at a check layer, and :mod:`blend.kernels.paged` gathers and
scatters KV of vLLM's paged caches by ``slot_mapping``. Every module exposes ``*_reference``
(plain torch, the definition), ``*_triton`` (the kernel launch, after its wrapper checked
shapes, dtypes, devices, contiguity and index ranges) and the entry point that
:mod:`blend.ops` dispatches to: the kernel on CUDA with Triton, the reference otherwise.

On CPU tensors ``*_triton`` runs the same kernel through Triton's interpreter, which Triton
enables only when ``TRITON_INTERPRET=1`` is set before it is first imported (CI's kernel
tests run in a subprocess for that reason, see ``tests/blend/kernels/``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

try:  # triton is optional at run time (CPU-only installs fall back to the references)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "Kernel", "interpreting", "triton", "tl", "use_triton"]

HAS_TRITON = triton is not None


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the fast path applies: Triton is importable and every tensor is on CUDA."""
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    if not HAS_TRITON:
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # triton without knobs
        import os

        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Kernel:
    """One kernel function, ``triton.jit``-ed on first use (importing needs no GPU).

    ``Kernel(fn).on(device)[grid](*args)`` launches it; on CPU tensors only under Triton's
    interpreter.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    @functools.cached_property
    def _jitted(self):
        return triton.jit(self.fn)

    def on(self, device: torch.device):
        """The launchable kernel for tensors on ``device``.

        Raises:
            RuntimeError: Triton is not installed, or CPU tensors without the interpreter.
        """
        if not HAS_TRITON:
            raise RuntimeError("triton is not installed")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(f"Triton kernels take {device} tensors only under TRITON_INTERPRET=1")
        return self._jitted
