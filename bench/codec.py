"""``python -m bench.codec``: what one decode step's token events cost to encode (decode worker) and to
decode with full validation (gateway): a TokenBatch of ``--events`` one-token TokenEvents."""

import argparse
import time

from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import TokenBatch, TokenEvent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, default=128)
    p.add_argument("--iterations", type=int, default=300)
    args = p.parse_args()
    batch = TokenBatch(events=[TokenEvent(request_id=f"{i:032x}-0", token_ids=[123], output_index=5, worker_id="w")
                               for i in range(args.events)])
    data = encode(batch)
    assert decode(data, TokenBatch) == batch
    for name, fn in (("encode", lambda: encode(batch)), ("decode", lambda: decode(data, TokenBatch))):
        t0 = time.perf_counter()
        for _ in range(args.iterations):
            fn()
        print(f"{name} TokenBatch({args.events}): {(time.perf_counter() - t0) / args.iterations * 1e3:.3f} ms "
              f"({len(data)} bytes)")


if __name__ == "__main__":
    main()
