"""The OpenAI-compatible front door: see gateway/app.py."""
