"""The prefill role: reads jobs, runs chunked prefill, hands the KV off to a decode worker."""
