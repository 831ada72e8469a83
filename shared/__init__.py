"""What every kvrelay process shares: config, protocol, Redis keys and the engine core. One subpackage per layer
of pyproject's import contracts, and no module of its own: a module here would sit in no layer, so nothing would
hold what it imports or who imports it."""
