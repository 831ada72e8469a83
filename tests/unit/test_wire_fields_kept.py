"""What keeps messages readable one protocol version apart, held for every message that crosses between
components (the ranks of one worker run one build, so theirs are left out): no field that was sent at protocol 1
goes away (an older sender still sends it, and a newer reader would refuse it as unknown), and every field
added since has a default (an older sender never sends it). wire_fields_protocol1.json is the fields then."""

import dataclasses
import json
from pathlib import Path

import pytest

from kvrelay.shared.wire import handoff as h
from kvrelay.shared.wire import protocol as p
from kvrelay.shared.wire.engine_stats import EngineStats, HistogramCounts
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

MESSAGES = (*p.MESSAGE_TYPES, EngineStats, HistogramCounts, SamplingParams, StructuredOutputs, h.HandoffRequest,
            h.HandoffRequests, h.KVIpcHandle, h.KVTarget, h.HandoffGrant, h.HandoffGrants, h.KVHeader, h.KVLayers,
            h.HandoffCancel, h.HandoffAck)
AT_PROTOCOL_1 = json.loads((Path(__file__).parent / "wire_fields_protocol1.json").read_text())


def _required(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_no_field_goes_away_and_every_new_one_has_a_default(cls):
    then = AT_PROTOCOL_1[cls.__name__]
    now = [f.name for f in dataclasses.fields(cls)]
    assert not set(then["fields"]) - set(now), "a field older peers send is gone: they would be refused"
    assert _required(cls) <= set(then["required"]), "a new field needs a default: older peers never send it"
