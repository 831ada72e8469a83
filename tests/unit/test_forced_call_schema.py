"""The schema a ``tool_choice: "required"`` request constrains its output to, for tools whose arguments
schemas use ``$defs`` and "#" references: each tool's schema becomes a branch of an array, where "#" is no
longer its root, so its definitions and references must move with it. Checked with jsonschema, which
resolves the references as the grammar engine does."""

import json

import jsonschema
import pytest

from kvrelay.gateway.api.forced_calls import call_constraint
from kvrelay.gateway.api.tool_schemas import ToolDefinition, plan_tools

OPTIONS = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
           "additionalProperties": False}


def tool(name: str, parameters: dict) -> ToolDefinition:
    return ToolDefinition.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


def required_schema(tools: list[ToolDefinition]) -> dict:
    plan = plan_tools(tools, "required", True, None, False)
    return json.loads(call_constraint(plan, tools).outputs.json)


def test_each_tools_definitions_and_references_follow_it_into_the_array():
    tools = [
        tool("weather", {"type": "object", "properties": {"options": {"$ref": "#/$defs/Options"}},
                         "required": ["options"], "$defs": {"Options": OPTIONS}}),
        # the same definition name in another tool, the older "definitions" keyword, and a reference to a
        # property of the tool's own root
        tool("forecast", {"type": "object", "properties": {
            "options": {"$ref": "#/definitions/Options"}, "again": {"$ref": "#/properties/days"},
            "days": {"type": "integer", "maximum": 7}},
            "required": ["options", "again"], "definitions": {"Options": {"enum": ["x"]}}}),
    ]
    schema = required_schema(tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    good = [{"name": "weather", "parameters": {"options": {"unit": "C"}}},
            {"name": "forecast", "parameters": {"options": "x", "again": 3}}]
    assert not list(validator.iter_errors(good))
    for bad in ([{"name": "weather", "parameters": {"options": {"unit": "K"}}}],  # its own Options
                [{"name": "forecast", "parameters": {"options": {"unit": "C"}, "again": 3}}],  # not weather's
                [{"name": "forecast", "parameters": {"options": "x", "again": 9}}]):  # #/properties/days
        assert list(validator.iter_errors(bad)), bad


@pytest.mark.parametrize("parameters", [{"type": "object", "properties": {"a": {"type": "string"}}}, None])
def test_tools_without_references_are_unchanged(parameters):
    schema = required_schema([tool("f", parameters)])
    assert "$defs" not in schema
    branch = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert branch == {"type": "object", **(parameters or {"properties": {}})}
