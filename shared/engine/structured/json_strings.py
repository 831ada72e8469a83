"""A JSON schema's length-bounded strings rewritten so the compiled grammar keeps their output valid JSON."""

import json


def strict_counted_strings(schema_text: str) -> str:
    """The schema with each length-bounded string (``minLength``/``maxLength``, no ``pattern``/``format``)
    given the same bounds as a ``pattern`` over characters JSON allows unescaped.

    xgrammar writes a length-bounded string as ``[^"\\\r\n]{min,max}``, which lets a tab or another control
    character through raw: text that ``json.loads`` and ``JSON.parse`` refuse. As a pattern it keeps them out
    (like its unbounded strings do). Text that is not JSON is returned as is, for the compile to refuse."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text
    changed = False

    def visit(node: object) -> None:
        nonlocal changed
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        low, high = node.get("minLength", 0), node.get("maxLength")
        bounded = "minLength" in node or "maxLength" in node
        integers = type(low) is int and (high is None or type(high) is int)  # else the compile judges them
        if node.get("type") == "string" and bounded and integers and "pattern" not in node and "format" not in node:
            node.pop("minLength", None), node.pop("maxLength", None)
            node["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{"" if high is None else high}}}$'
            changed = True
        for value in node.values():
            visit(value)

    visit(schema)
    return json.dumps(schema) if changed else schema_text
