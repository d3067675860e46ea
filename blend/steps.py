"""A request as a generator of layer steps: driving it, and timing the work inside it.

:meth:`blend.engine.BlendEngine.blend_steps` yields once per layer so that a caller can
interleave other work between layers (vLLM's async-load path slices a long blend across engine
steps, and other requests keep decoding). What each request measured goes to the cost
estimates of the scheduler half (:mod:`cluster.vllm.costs`) as ``counters.compute_s``: the
seconds spent *inside* the steps, never the caller's time between them.

On a GPU the host only queues kernels: a prefill without logits returns to the host long
before the device has run it. The time therefore ends with one wait for the device at the end
of the request (:func:`wait_for_device`; nothing on the CPU, nothing per layer). Without it, on
an H100 the prefills that seed the cost estimates (``kvblend bench gpu --placement``) priced full
prefill at half its time (0.072 s predicted, 0.105-0.110 s measured at 4K), and the planner chose
full prefill where loading was 1.5x faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

import torch

from blend.result import BlendResult


def run_steps(steps: Generator[int, None, BlendResult]) -> BlendResult:
    """Drive a step generator (:meth:`blend.engine.BlendEngine.blend_steps`) to its end,
    gradients off; returns its result."""
    with torch.no_grad():
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value


def timed_steps(steps: Generator[int, None, BlendResult], spent: list[float],
                done: Callable[[], None] | None = None) -> Generator[int, None, BlendResult]:
    """Pass ``steps`` through, adding the seconds spent inside each step to ``spent[0]``;
    closing it closes ``steps``. ``done`` runs inside the last step, after ``steps`` returned
    (the engine passes its device wait), so the time ends when the device's work has, not when
    the host queued it."""
    try:
        while True:
            t0 = time.perf_counter()
            try:
                layer_idx = next(steps)
            except StopIteration as stop:
                if done is not None:
                    done()
                return stop.value
            finally:
                spent[0] += time.perf_counter() - t0
            yield layer_idx
    finally:
        steps.close()


def wait_for_device(device: torch.device) -> None:
    """Wait until ``device`` has run the work queued on it (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
