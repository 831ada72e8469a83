"""Benchmarks behind ``kvrelay bench``: each prints its result beside a baseline measured in the same run."""
