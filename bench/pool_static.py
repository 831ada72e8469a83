"""The static split of ``kvrelay bench pool`` (bench/pool_density.py): one engine per served model, each with a
fixed share of the memory and a private KV cache, loaded before the run; requests for a model without one fail."""

import argparse

from kvrelay.bench.pool_models import Models
from kvrelay.bench.pool_steps import Run
from kvrelay.bench.pool_workload import Arrival


class StaticRun(Run):
    def __init__(self, args: argparse.Namespace, models: Models, arrivals: list[Arrival], served: list[int],
                 kv_bytes: int):
        super().__init__(args, models, arrivals)
        for i in served:
            self.cores[i] = models.load(i, kv_bytes=kv_bytes)

    def arrive(self, k: int) -> None:
        if self.arrivals[k].model in self.cores:
            self.submit(k)
        else:
            self.outcomes[k].failed = True  # no engine for it: the split had no room
