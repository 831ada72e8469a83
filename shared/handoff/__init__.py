"""Moving a finished prefill's KV blocks to a decode worker: CUDA IPC on one host, frames over ZMQ
across hosts."""
