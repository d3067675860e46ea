"""Where a kvblend request's time to first token goes, from the client's clock and the
connector's events (issue 36).

One measured request, on the wall clock (``time.time()``: the client and the connector's
:class:`~cluster.vllm.events.EventLog` run on one machine)::

    sent ─ front ─┬ plan ┬─ to_load ─┬──────────── load (blend) ────────────┬─ after_load ─ first token
                  │      │           │ probe ⊂ compute │ wait for KV │ gaps │
            plan starts  lookup      the worker starts                 finished_recving, the query
            (scheduler)  event       the blend                         tail's forward, streaming

* ``front_s``: HTTP, tokenization and vLLM's queue, up to the scheduler half's plan;
* ``plan_s``: segments found and the batched lookup (through the cache agent), the lookup
  event's ``plan_s``;
* ``to_load_s``: from the plan to the worker's first blend step (the engine steps between);
* ``load_s``: the blend's wall time in the worker (``wall_s`` of its ``load`` event), split
  into ``probe_s`` (the query-attention probe), ``compute_s`` (the rest of the blend's compute,
  paged-cache writes included), ``load_wait_s`` (waiting for chunk layers) and
  ``load_gaps_s`` (the blend waited between engine steps: vLLM's own work in those steps);
* ``after_load_s``: from the blend's end to the first streamed token;
* ``other_stores_s``: seconds of this request's TTFT during which the other replica's store
  events (canonical KV computed and put after its own requests) were running: on a machine
  whose replicas share cores, their compute slows this request down.

Front-end code only: reads plain dicts, imports neither torch nor vLLM.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

PARTS = ("front_s", "plan_s", "to_load_s", "load_s", "probe_s", "compute_s", "load_wait_s",
         "load_gaps_s", "after_load_s", "other_stores_s")


def _of(events: Sequence[dict], kind: str, request_id: str) -> dict | None:
    """The last ``kind`` event of the vLLM request whose id starts with the response id
    ``request_id`` (vLLM appends ``-<index>-<random>`` to it), or None."""
    found = None
    for e in events:
        rid = str(e.get("request_id", ""))
        if e.get("event") == kind and (rid == request_id or rid.startswith(request_id + "-")):
            found = e
    return found


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def request_breakdown(request: dict, events: Sequence[dict]) -> dict | None:
    """The parts of one request's TTFT (module docstring), or None when its events are
    missing (no lookup or no load: it was not blended).

    Args:
        request: ``{"id", "sent_at", "ttft_s"}`` (:class:`cluster.workloads.replicas.Completion`).
        events: every connector event of the run (:func:`cluster.vllm.events.read_events`).
    """
    rid = str(request.get("id", ""))
    if not rid:
        return None
    lookup, load = _of(events, "lookup", rid), _of(events, "load", rid)
    if lookup is None or load is None or load.get("path") != "blend":
        return None
    sent, ttft = float(request["sent_at"]), float(request["ttft_s"])
    first = sent + ttft
    plan_s = float(lookup.get("plan_s", 0.0) or 0.0)
    lookup_t = float(lookup["time"])
    load_end = float(load["time"])
    wall = float(load.get("wall_s", 0.0) or 0.0)
    load_start = load_end - wall
    probe = float(load.get("probe_s", 0.0) or 0.0)
    compute = float(load.get("compute_s", 0.0) or 0.0)
    wait = float(load.get("load_wait_s", 0.0) or 0.0)
    pid = load.get("pid")
    stores = 0.0
    for e in events:
        if e.get("event") == "store" and e.get("pid") != pid:
            end = float(e["time"])
            stores += _overlap(sent, first, end - float(e.get("seconds", 0.0) or 0.0), end)
    return {"id": rid, "ttft_s": ttft, "front_s": lookup_t - plan_s - sent, "plan_s": plan_s,
            "to_load_s": load_start - lookup_t, "load_s": wall, "probe_s": probe,
            "compute_s": compute - probe, "load_wait_s": wait,
            "load_gaps_s": max(0.0, wall - compute - wait), "after_load_s": first - load_end,
            "other_stores_s": stores, "engine_steps": load.get("engine_steps"),
            "busy_steps": load.get("busy_steps")}


def ttft_breakdown(requests: Sequence[dict], events: Sequence[dict]) -> dict:
    """``{"requests": [per request], "median": {part: s}, "median_share": {part: share of
    the median TTFT}, "explained": n}`` over the requests that were blended."""
    rows = [r for r in (request_breakdown(q, events) for q in requests) if r is not None]
    out: dict = {"requests": rows, "explained": len(rows), "sent": len(requests)}
    if rows:
        med = {p: statistics.median(r[p] for r in rows) for p in ("ttft_s", *PARTS)}
        out["median"] = med
        out["median_share"] = {p: med[p] / med["ttft_s"] for p in PARTS if med["ttft_s"] > 0}
    return out


def format_breakdown(b: dict) -> str:
    """One printable line per part: median seconds and share of the median TTFT."""
    if not b.get("requests"):
        return f"TTFT breakdown: none of {b.get('sent', 0)} requests had lookup and blend events"
    med, share = b["median"], b.get("median_share", {})
    lines = [f"kvblend TTFT breakdown ({b['explained']} of {b['sent']} requests; medians, "
             f"TTFT p50 {med['ttft_s']:.3f} s):"]
    for p in PARTS:
        lines.append(f"  {p:<15} {med[p]:8.3f} s  {share.get(p, 0.0):5.1%}")
    return "\n".join(lines)
