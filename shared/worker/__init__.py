"""The process runtime every worker role shares: hosted models, heartbeats, metrics, events."""
