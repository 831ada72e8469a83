"""Typed settings for every role, and the CLI flags and YAML validation built from them."""
