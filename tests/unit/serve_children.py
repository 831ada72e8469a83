"""What ``kvrelay serve`` would start for a command line, planned in this process (nothing starts), and a setting
read from a config by its path of field names."""

from kvrelay.cli import build_parser
from kvrelay.serve_plan import Child, models_to_serve, plan


def serve_children(argv: list[str]) -> dict[str, Child]:
    """The children of ``kvrelay serve ARGV`` by command (gateway, prefill-worker, ...)."""
    args = build_parser().parse_args(["serve", *argv])
    return {c.command: c for c in plan(args, models_to_serve(args), "redis://127.0.0.1:6379/0")}


def setting_at(config, path: tuple[str, ...]):
    """``config``'s setting at ``path``, in a config object or its printed JSON."""
    for name in path:
        config = config[name] if isinstance(config, dict) else getattr(config, name)
    return config
