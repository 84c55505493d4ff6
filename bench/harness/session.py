"""A bench's life on the bed: the options every such bench takes, the bed built, the body
run, and the bed taken down whatever happens (an error, Ctrl-C, SIGTERM)."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from bench.harness.jobs import BenchError, Interrupted
from bench.harness.strategies import StrategyCase, parse_strategies
from tests.netbed import Testbed, TestbedError, check_requirements, rate_bits, reap_stale_beds

#: The model ``--quick`` trains: chargpt-bench made small.
QUICK_MODEL = ["n_layer=2", "n_embd=128", "val_size=32"]


def add_job_arguments(parser: argparse.ArgumentParser, *, subnet: str, wait_max: float = 2400,
                      batch_help: str = "samples per host per step") -> None:
    """The options :class:`bench.harness.jobs.Bench` and :func:`on_bed` read."""
    parser.add_argument("--profile", default="chargpt-bench", help="profile in config.ini")
    parser.add_argument("--batch-size", type=int, default=16, help=batch_help)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="profile override for every job (e.g. n_layer=2)")
    parser.add_argument("--quiet-cores", type=float, default=0.25,
                        help="before each job, wait until other processes keep fewer cores busy")
    parser.add_argument("--retry-cores", type=float, default=0.35,
                        help="measure a job again when others took more cores in its window")
    parser.add_argument("--wait-max", type=float, default=wait_max,
                        help=f"seconds in all to wait for a quiet machine (default {wait_max:g})")
    parser.add_argument("--subnet", default=subnet, help="the hosts' /24 (three octets)")
    parser.add_argument("--queue", default="100ms",
                        help="tbf queue of each link, as the time it takes to drain "
                             "(tc's latency; default 100ms: at 20mbit it holds 250 kB, more "
                             "than one DeMo burst; a burst that overflows the queue loses its "
                             "tail and TCP waits a 200 ms retransmission timeout)")


def add_window_arguments(parser: argparse.ArgumentParser, *, quick_window: int) -> None:
    """``--warmup``, ``--window``, ``--periods`` and ``--quick`` (see :func:`settle_quick`)."""
    parser.add_argument("--warmup", type=int, default=5, help="steps before the timed window")
    parser.add_argument("--window", type=int, default=None,
                        help=f"fewest timed steps (default 40; --quick: {quick_window})")
    parser.add_argument("--periods", type=int, default=2,
                        help="fewest whole communication periods timed (DiLoCo rounds)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small model ({', '.join(QUICK_MODEL)}), {quick_window}-step "
                             "windows, no waiting for a quiet machine")
    parser.set_defaults(quick_window=quick_window)


def add_sweep_arguments(parser: argparse.ArgumentParser, *, rates: str, strategies: str,
                        repeat: int, subnet: str, quick_window: int) -> None:
    """What a bench that measures strategies at several link rates takes: ``--rates``,
    ``--strategies``, ``--repeat``, and the job's and the window's options."""
    parser.add_argument("--rates", default=rates, help=f"link rates, tc syntax (default {rates})")
    parser.add_argument("--strategies", default=strategies,
                        help=f"ddp, diloco[:H], streaming_diloco[:H[:F]], sparseloco[:H], sparta[:p], "
                             f"demo[:topk] (default {strategies})")
    parser.add_argument("--repeat", type=int, default=repeat,
                        help=f"rounds over every job; figures are medians (default {repeat})")
    add_job_arguments(parser, subnet=subnet)
    add_window_arguments(parser, quick_window=quick_window)


def settle_sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[StrategyCase]:
    """Apply ``--quick``, turn ``--rates`` into a list and return ``--strategies`` parsed; exit
    with the message on a value that cannot work."""
    settle_quick(args, parser)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    try:
        args.rates = parse_rates(args.rates)
        return parse_strategies(args.strategies)
    except ValueError as exc:
        parser.error(str(exc))


def parse_rates(text: str) -> list[str]:
    """``1gbit,100mbit`` -> ``["1gbit", "100mbit"]``; ValueError naming a rate tc would refuse."""
    rates = [r.strip() for r in text.split(",") if r.strip()]
    for rate in rates:
        rate_bits(rate)
    if not rates:
        raise ValueError("no link rate given: e.g. --rates 100mbit,1gbit")
    return rates


def settle_quick(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Apply ``--quick`` and the window's default; exit with a message on a bad value."""
    if args.quick:
        args.set = [*QUICK_MODEL, *args.set]
        args.warmup, args.periods = 5, 1
        args.wait_max, args.retry_cores = 0, math.inf
    if args.window is None:
        args.window = args.quick_window if args.quick else 40
    if min(args.batch_size, args.window, args.periods, args.warmup) < 1:
        parser.error("--batch-size, --window, --periods and --warmup must be >= 1")


@contextlib.contextmanager
def signals_raise() -> Iterator[dict[str, bool]]:
    """SIGINT/SIGTERM raise ``Interrupted`` unless ``state['cleaning']`` (then they wait)."""
    state = {"cleaning": False}

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if state["cleaning"]:
            print(f"{name}: still removing namespaces and processes; one moment", flush=True)
            return
        raise Interrupted(name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def on_bed(command: str, body: Callable[[Testbed], int], *, hosts: int, subnet: str,
           pin: bool = True, queue: str = "100ms",
           reap_also: Callable[[], list[str]] | None = None,
           also_needs: Callable[[], list[str]] | None = None) -> int:
    """Run ``body`` on a fresh bed of ``hosts`` hosts, then take the bed down.

    What earlier benches left behind is removed first (their beds, and what
    ``reap_also`` removes). Returns ``body``'s exit code; 2 when this machine
    cannot host the bed (said, with the fixes), 130 on Ctrl-C or SIGTERM, 1 on a
    bench or bed error (printed) or when part of the bed could not be removed.
    ``also_needs`` says what else the bench needs of this machine (e.g.
    :func:`bench.harness.slow_host.cgroup_problems`), checked with the bed's needs.
    """
    problems = check_requirements(pin) + (also_needs() if also_needs else [])
    if problems:
        print(f"{command} cannot run here:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    code = 0
    with signals_raise() as state:
        bed = None
        try:
            stale = reap_stale_beds() + (reap_also() if reap_also else [])
            if stale:
                print("removed what an earlier benchmark left behind: " + ", ".join(stale),
                      flush=True)
            bed = Testbed(hosts, subnet, pin, queue=queue)
            print(f"building {hosts} hosts ({bed.bridge_ns}, ...)", flush=True)
            bed.build()
            code = body(bed)
        except Interrupted as exc:
            print(f"\ninterrupted by {exc}: stopping", file=sys.stderr, flush=True)
            code = 130
        except (BenchError, TestbedError, ValueError, RuntimeError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            code = 1
        finally:
            state["cleaning"] = True
            if bed is not None:
                bed.close()
                left = bed.leftovers()
                if left:
                    print("could not remove: " + ", ".join(left), file=sys.stderr)
                    code = code or 1
                else:
                    print(f"cleaned up: namespaces {bed.bridge_ns.rsplit('-', 1)[0]}-*, the "
                          "uplink, every sshd and rank are gone", flush=True)
    return code
