"""Tenancy: API keys and who is asking (``auth.py``), tenants, their limits and usage, and the admin API
that manages them."""
