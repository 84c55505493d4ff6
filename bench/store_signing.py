"""What signing the store costs a run across hosts: each store call, signed and plain.

A run across hosts signs every store value (``exogym.comm.store.SignedStore``).
This times the calls the ranks make, against a store on loopback (the cost of a
call there is the store's own; a LAN adds the same round trips to both):

- ``set``, ``get``, ``check`` and ``compare_set`` (a vote), one value each;
- ``add`` (a counter: read, then compare-and-set when signed);
- a vote as :class:`exogym.comm.elastic_groups.ElasticGroups` casts one per call
  of a run whose hosts come and go: compare-and-set, check, read the votes, count.

Run from the project root::

    python -m bench.store_signing
    python -m bench.store_signing --calls 5000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from rich.console import Console

from bench.harness.tables import print_table
from exogym.comm.store import ControlStore, new_run_key, open_store


def per_call_us(call: Callable[[int], object], calls: int, repeats: int = 5) -> float:
    """The median over ``repeats`` of the mean microseconds of ``call(i)``."""
    means = []
    for r in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            call(r * calls + i)
        means.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(means)


def calls_of(store: ControlStore, space: str) -> dict[str, Callable[[int], object]]:
    """Each timed call on ``store``, on keys under ``space`` alone."""
    value = b"x" * 64
    store.set(f"{space}/read/me", value)

    def vote(i: int) -> None:
        base = f"{space}/v/{i}"
        store.compare_set(f"{base}/0", "", b"ok")
        store.check([f"{base}/0"])
        store.multi_get([f"{base}/0"])
        store.add(f"{base}/n", 1)

    return {
        "set": lambda i: store.set(f"{space}/s/{i}", value),
        "get": lambda i: store.get(f"{space}/read/me"),
        "check": lambda i: store.check([f"{space}/read/me"]),
        "compare_set": lambda i: store.compare_set(f"{space}/c/{i}", "", value),
        "add": lambda i: store.add(f"{space}/counter", 1),
        "one vote": vote,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per timing")
    args = parser.parse_args(argv)
    key = new_run_key()
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    plain = open_store("127.0.0.1", master.port, timeout_s=30)
    signed = open_store("127.0.0.1", master.port, timeout_s=30, key=key)
    plain_calls, signed_calls = calls_of(plain, "plain"), calls_of(signed, "signed")
    rows = []
    for name in plain_calls:
        # The two timings alternate, so a busy machine weighs on both alike.
        a = per_call_us(plain_calls[name], args.calls)
        b = per_call_us(signed_calls[name], args.calls)
        rows.append([name, f"{a:.0f}", f"{b:.0f}", f"{b / a:.2f}x"])
    print_table("store calls on loopback (microseconds a call, median of 5)",
                ["call", "plain", "signed", "signed / plain"], rows, console=Console())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
