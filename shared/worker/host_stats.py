"""The host's own series in a worker's metrics: node load and, when NVML imports and the worker runs on a
GPU, that GPU's utilisation and memory, read at scrape time."""

import logging
import os

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)


class HostCollector:
    """Node load and, when NVML imports and the worker runs on a GPU, that GPU's utilisation and memory.
    Read at scrape time; an NVML error drops the GPU series from that scrape rather than failing it."""

    def __init__(self, nvml=None, gpus: list[tuple[str, object]] = ()):
        self.nvml = nvml  # the pynvml module (or a stand-in with its functions)
        self.gpus = list(gpus) if nvml is not None else []  # (uuid, NVML handle)

    def collect(self):
        load = os.getloadavg()
        for minutes, value in zip((1, 5, 15), load, strict=True):
            yield GaugeMetricFamily(f"kvrelay_node_load{minutes}", f"Host load average over {minutes} min",
                                    value=value)
        if not self.gpus:
            return
        util = GaugeMetricFamily("kvrelay_gpu_utilization_ratio", "GPU busy fraction (NVML, last sample period)",
                                 labels=["gpu"])
        used = GaugeMetricFamily("kvrelay_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["gpu"])
        total = GaugeMetricFamily("kvrelay_gpu_memory_total_bytes", "GPU memory (NVML)", labels=["gpu"])
        for uuid, handle in self.gpus:
            try:
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:  # a driver hiccup must not take the whole scrape down
                log.debug("NVML query failed for %s", uuid, exc_info=True)
                continue
            util.add_metric([uuid], rates.gpu / 100.0)
            used.add_metric([uuid], mem.used)
            total.add_metric([uuid], mem.total)
        yield from (util, used, total)


def _import_nvml():
    try:
        import pynvml  # the nvidia-ml-py package

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, or no driver: GPU metrics are simply absent
        return None


def nvml_for(device: str) -> tuple[object, list[tuple[str, object]]]:
    """NVML and the handle of the GPU this worker computes on, matched by UUID (CUDA and NVML number
    devices differently under CUDA_VISIBLE_DEVICES); (None, []) when not on CUDA or without NVML."""
    if not device.startswith("cuda"):
        return None, []
    nvml = _import_nvml()
    if nvml is None:
        return None, []
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    try:
        return nvml, [(uuid, nvml.nvmlDeviceGetHandleByUUID(uuid))]
    except Exception:
        log.warning("NVML does not know GPU %s; GPU metrics disabled", uuid, exc_info=True)
        return None, []
