"""What the job-queue tests (test_job_queue.py, test_job_queue_private.py, test_job_queue_priority.py, and
test_job_queue_cluster.py, which runs them again on a Redis Cluster) share: a job of model MODEL and a queue of it."""

import time

from kvrelay.shared.wire.job_queue import JobQueue
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.sampling_params import SamplingParams

MODEL = "m"


def make_job(rid: str, priority: int = 0) -> Job:
    return Job(request_id=rid, model=MODEL, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4), tenant="t",
               priority=priority, reply_addr="tcp://127.0.0.1:1", deadline=time.time() + 60, arrival=time.time())


def make_queue(r, consumer: str, idle_ms: int = 0, on_dead=None, stalled_step_timeout_s: float = 0.0,
               priority_bands: bool = False) -> JobQueue:
    """A new queue reclaims and adopts on its first fetch; a job's third delivery is its last. ``priority_bands``:
    a queue of a model served under --scheduling-policy priority."""
    return JobQueue(r, MODEL, consumer, reclaim_idle_ms=idle_ms, max_deliveries=3, on_dead=on_dead,
                    stalled_step_timeout_s=stalled_step_timeout_s, priority_bands=priority_bands)
