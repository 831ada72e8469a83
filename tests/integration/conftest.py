"""The KV handoff tests' two sides (tests/integration/handoff_harness.py) as fixtures: ``prefill`` gives
(the prefill endpoint, a maker of HandoffManagers), ``decode_side`` a maker of DecodeSides; each closes
what it made after the test."""

import pytest

from tests.integration.handoff_harness import decode_sides, prefill_side


@pytest.fixture()
def prefill():
    yield from prefill_side()


@pytest.fixture()
def decode_side():
    yield from decode_sides()
