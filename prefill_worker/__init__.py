"""The prefill role: reads jobs, runs chunked prefill, hands the KV off (or decodes it, unified)."""
