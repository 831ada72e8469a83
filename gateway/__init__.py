"""The OpenAI-compatible front door, in rooms by concern: ``api/`` (the OpenAI API), ``tenancy/`` (API
keys, tenants, limits, usage) and ``control/`` (the model control plane); ``app.py`` builds the app that
wires them, ``routes.py`` is its one routes table."""
