"""When a worker counts as stalled: live by its heartbeat, which does not wait for steps
(shared/worker/registration.py), but in one step (``WorkerInfo.step_age_s``) for longer than
``--stalled-step-timeout-s`` (a GPU hang, a deadlocked kernel, a stuck handoff). The gateway routes no new job to
one (gateway/control/stalled_workers.py); a prefill worker hands it no KV (prefill_worker/handoff.py); its peers
take the jobs routed to its private stream that it has not read (shared/wire/job_adoption.py)."""

from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.protocol import WorkerInfo


def stalled(worker: WorkerInfo, timeout_s: float) -> bool:
    """Whether ``worker`` has been in one step for longer than ``timeout_s`` (0: none ever is)."""
    return 0 < timeout_s < worker.step_age_s


def why_stalled(step_age_s: float, timeout_s: float) -> str:
    return f"its engine has been in one step for {step_age_s:.0f} s, over --stalled-step-timeout-s {timeout_s:g}"


def stalled_record(record: bytes, timeout_s: float) -> WorkerInfo | None:
    """The worker of a heartbeat record (``redis_keys.worker_key``) if it is stalled; None if it steps, or if
    the record does not decode (a newer worker's must-understand field): a worker not understood is not judged."""
    try:
        worker = decode(record, WorkerInfo)
    except ValueError:
        return None
    return worker if stalled(worker, timeout_s) else None
