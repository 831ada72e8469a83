"""Typed settings for every role, each declared once with its default, help and bounds, and the generator
that turns declarations into CLI flags (``flags.py``) and validates what a parent hands a child
(``handover.py``). Which flags each command takes, and the serve YAML, are the CLI's (``kvrelay/``)."""
