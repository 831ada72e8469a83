"""The server's own split of TTFT into stages over one sweep trial: the gateway's /metrics scraped before
and after the trial (kvrelay/ttft_readout.py diffs and reads them) and the split printed under the trial's
row. A server without these series (not kvrelay, or an older gateway) gives an empty split."""

import asyncio
import urllib.request

from kvrelay.gateway.ttft_stages import STAGES
from kvrelay.ttft_readout import Scrape, parse


async def scrape(base_url: str) -> Scrape:
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode()

    try:
        return parse(await asyncio.to_thread(get))
    except OSError:
        return {}


def print_breakdown(b: dict, indent: int = 5) -> None:
    """Rows under a trial's row: p50, p99 and mean of each stage, and the slowest requests' mean; a mean
    row's sum beside the gateway's mean TTFT, which it should match unless some requests were not split
    (said last)."""
    pad = " " * indent
    _print_stages(b, pad)
    if b["unsplit"]:
        print(f"{pad}{b['unsplit']} request(s) not split (their workers sent no stamps): in the gateway's mean "
              "TTFT, not in the stages", flush=True)


def _print_stages(b: dict, pad: str) -> None:
    if not b["stages"]:
        print(f"{pad}TTFT stages: none reported (a server without kvrelay_ttft_stage_seconds)")
        return
    names = [s for s in STAGES if s in b["stages"]]
    print(f"{pad}{'TTFT stages (ms, server)':<26}" + "".join(f"{s:>13}" for s in names) + f"{'sum':>9}")
    for stat in ("p50", "p99", "mean"):
        values = [b["stages"][s][f"{stat}_ms"] for s in names]
        total = f"{sum(values):>9.1f}" if stat == "mean" else f"{'':>9}"
        print(f"{pad}{stat:<26}" + "".join(f"{v:>13.1f}" for v in values) + total)
    if b["ttft_mean_ms"] is not None:
        print(f"{pad}{'gateway TTFT mean':<26}{'':>{13 * len(names)}}{b['ttft_mean_ms']:>9.1f}")
    tail = b["tail"]
    if tail:
        values = [tail["mean_ms"].get(s, 0.0) for s in names]
        label = f"slowest {tail['requests']} (>{tail['ttft_above_ms']:.0f} ms) mean"
        print(f"{pad}{label:<26}" + "".join(f"{v:>13.1f}" for v in values) + f"{sum(values):>9.1f}", flush=True)
