"""One rank of a two-rank gloo group that all-reduces 16 MiB in 2 MiB buckets while its
monitor reports about once a second; prints every event the monitor emits as a JSON line
with its arrival time, then whether the sum came out exact (tests/test_link_monitor.py).

    python tests/scripts/link_progress_rank.py RANK MASTER_ADDR MASTER_PORT
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from distributed.worker.environment import choose_interface
from exogym import comm
from exogym.run.monitor import RankMonitor

VALUES = 4 * 2**20  # float32: 16 MiB
PIECE = 2**19  # float32: 2 MiB, one bucket each


def main() -> None:
    rank, addr, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    interface = choose_interface(addr)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    store = comm.open_store(addr, port, is_master=rank == 0, world_size=2, timeout_s=60)
    comm.init_process_group(store, rank, 2, "gloo", timeout_s=120)
    values = torch.arange(VALUES, dtype=torch.float32) * (rank + 1)
    pieces = [values[i:i + PIECE] for i in range(0, VALUES, PIECE)]
    comm.side_barrier()

    def emit(event: dict) -> None:
        print(json.dumps({"t": time.monotonic(), **event}), flush=True)

    monitor = RankMonitor(rank, emit)
    comm.all_reduce_tensors(pieces, bucket_bytes=PIECE * 4)
    monitor.stop()
    exact = torch.equal(values, torch.arange(VALUES, dtype=torch.float32) * 3)
    print(json.dumps({"event": "result", "exact": exact, "comm_bytes": comm.comm_bytes()}),
          flush=True)
    comm.side_barrier()
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
