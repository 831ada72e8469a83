"""What the heartbeat says of a worker's model instances: the ready and draining ones, those loading, and
those that failed (kept for the admin API a while, shared/worker/model_host.py)."""

from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.wire.protocol import InstanceStatus
from kvrelay.shared.worker.model_loads import Loading
from kvrelay.shared.worker.model_slot import ModelSlot, group_status


def instance_statuses(pool: KVPool | None, slots: dict[str, ModelSlot], loading: dict[str, Loading],
                      failed: dict[str, tuple[str, str, int, float]]) -> list[InstanceStatus]:
    out = []
    lendable = pool.reclaimable_bytes() if pool is not None else 0  # what the pool could add
    for s in slots.values():
        out.append(InstanceStatus(instance=s.instance, name=s.name, version=s.version, state=s.state,
                                  weight_bytes=s.weight_bytes, kv_blocks=s.core.num_total_blocks,
                                  kv_free_blocks=s.core.num_free_blocks + lendable // s.core.block_bytes,
                                  running=s.core.num_running,
                                  waiting=s.core.num_waiting, idle_s=round(s.idle_s, 3), pinned=s.pinned,
                                  load_s=round(s.load_s, 3), overhead_bytes=s.overhead_bytes,
                                  step_peak_bytes=s.step_peak_bytes,
                                  engine=s.metrics.engine_stats() if s.metrics is not None else None,
                                  **group_status(s.core.config, s.core.rank_processes(), s.rank_weight_bytes or [s.weight_bytes])))
    for inst, ld in loading.items():
        out.append(InstanceStatus(instance=inst, name=ld.plan.name, version=ld.plan.version, state="loading",
                                  weight_bytes=ld.plan.weight_bytes, pinned=ld.plan.pinned,
                                  overhead_bytes=ld.plan.overhead_bytes, step_peak_bytes=ld.plan.step_peak_bytes,
                                  **group_status(ld.plan.engine, [], ld.plan.rank_weight_bytes)))
    for inst, (error, name, version, _) in failed.items():
        if inst not in slots and inst not in loading:
            out.append(InstanceStatus(instance=inst, name=name, version=version, state="failed",
                                      error=error[:2000]))
    return out
