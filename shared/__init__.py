"""What every kvrelay process shares: config, protocol, Redis keys and the engine core."""
