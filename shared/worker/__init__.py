"""The process runtime every worker role shares: hosted models, job intake, heartbeats, metrics, events."""
