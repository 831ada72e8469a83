"""What the tests of a load through a Redis failure (a restart, a failover) share: one request's timed
outcome, and an asyncio wait for a condition, bounded."""

import asyncio
import time
from dataclasses import dataclass

from tests.e2e.sse_client import Outcome


@dataclass
class Sample:
    started: float  # monotonic
    ended: float
    out: Outcome


async def until(predicate, timeout: float, what: str) -> None:
    """Until ``predicate()`` holds; an assertion error naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.05)
