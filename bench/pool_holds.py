"""What ``kvrelay bench pool`` (bench/pool_density.py) prints about cold loads and the resident models' steps
beside them: how long each load held the step lock, continuously and in all, by phase of the load (the lock is
the one thing a load may keep the others' steps from, shared/worker/step_lock.py), and how long the rounds of
steps waited for it and each step took while a load ran, against the steps without one (what a load costs
them otherwise: the GIL, the device)."""

from kvrelay.bench.pool_models import PHASES
from kvrelay.bench.pool_workload import percentile
from kvrelay.shared.worker.step_lock import HoldTimes

CAPTURE = "graph capture"  # holds taken within the engine build, for one CUDA graph each


def holds_lines(holds: list[HoldTimes], phases: list[dict[str, float]]) -> list[str]:
    """The summary line, then one per phase: over the loads, the longest hold of any, the median per load of the
    count and total, and of the phase's wall seconds."""
    if not holds:
        return ["  loads held the step lock: no load was timed"]
    longest = max((h.longest() for h in holds), key=lambda h: h[1])
    totals = [h.total() for h in holds]
    lines = [f"  loads held the step lock: longest {longest[1]:.3f} s ({longest[0] or 'never taken'}), total "
             f"{percentile(totals, 50):.3f} s per load (median; max {max(totals):.3f} s) over {len(holds)} load(s)"]
    parts = []
    for phase in (*PHASES[:2], CAPTURE, *PHASES[2:]):
        by = [h.by_phase().get(phase, []) for h in holds]
        wall = [p[phase] for p in phases if phase in p]
        text = f"{phase}" + (f" {percentile(wall, 50):.2f} s" if wall else "")
        if any(by):
            text += (f": {percentile([len(b) for b in by], 50):.0f} hold(s), longest {max(max(b, default=0.0) for b in by):.3f} s, "
                     f"total {percentile([sum(b) for b in by], 50):.3f} s")
        else:
            text += ": lock not taken"
        parts.append(text)
    lines.append("    by phase (median per load; longest of all): " + "; ".join(parts))
    return lines


def steps_line(lock_waits: list[float], steps: dict[bool, list[float]], by_phase: dict[str, list[float]]) -> str:
    """The resident models' side: their rounds' waits for the lock and their steps, while a load ran and not, and
    while a load ran by the phase it was in."""
    during, other = steps[True], steps[False]
    if not during:
        return "  resident steps while a load ran: none"
    phases = "; ".join(f"{phase or 'starting'} p50 {percentile(s, 50) * 1000:.1f} / p99 {percentile(s, 99) * 1000:.1f} ms "
                       f"({len(s)})" for phase, s in by_phase.items())
    return (f"  resident steps while a load ran: a round waited for the step lock at most {max(lock_waits, default=0.0):.3f} s "
            f"(p99 {percentile(lock_waits, 99):.3f} s); a step p50 {percentile(during, 50) * 1000:.1f} ms, p99 "
            f"{percentile(during, 99) * 1000:.1f} ms, max {max(during) * 1000:.1f} ms over {len(during)} (without a "
            f"load: p50 {percentile(other, 50) * 1000:.1f} ms, p99 {percentile(other, 99) * 1000:.1f} ms, max "
            f"{max(other, default=float('nan')) * 1000:.1f} ms)\n    resident steps by the load's phase: {phases}")
