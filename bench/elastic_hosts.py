"""What a lost host costs a run whose hosts come and go (``--min-nodes``), measured for real.

Three hosts: the master (this machine, with the launcher and rank 0) and two
network namespaces with an sshd each (:mod:`netbed`), DiLoCo (H=20) on digits
with ``min_nodes=2``. Each scenario hits rank 2's host once and prints, from
the launcher's receipt of the ranks' events:

- **time lost**: from the hit to the survivors' next completed round (a step
  of rank 0 that ends a round) — what the loss cost the others. Target: 15 s;
- **back to work**: from the host answering again to the returning rank's
  first completed round — target: one round plus 10 s;
- the round time before the hit, the membership changes and the final
  validation loss against the one at the hit.

Scenarios (``--scenarios``):

- ``kill``: its sshd stopped, then its rank killed (``kill -9``); the sshd is
  started again after ``--away`` seconds (the launcher's probe then starts the
  rank anew);
- ``freeze``: its rank stopped (``SIGSTOP``) for ``--away`` seconds, then
  continued (the same process rejoins; it is dropped after ``lost_after``);
- ``link``: its link set down for ``--away`` seconds, then up.

    python -m bench.elastic_hosts
    python -m bench.elastic_hosts --scenarios kill --away 5

Needs root, iproute2 and sshd (``tests/setup_system.sh``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from io import StringIO
from pathlib import Path

from bench.harness.outage import HostOutage
from bench.harness.tables import print_table
from tests.netbed import Events, Testbed, check_requirements, free_port, worker_pid

H = 20


class _Stamped(StringIO):
    """The launcher's messages on stderr, each with the time it came (BENCH_DEBUG=1)."""

    def write(self, text: str) -> int:
        if text.strip():
            sys.stderr.write(f"{time.strftime('%H:%M:%S')}.{int(time.time() % 1 * 1000):03d} "
                             f"{text}")
        return len(text)


def _show(line: object) -> None:
    if getattr(line, "rank", None) == 2:
        _Stamped().write(f"{line}\n")


def round_end(rank: int):
    return lambda e: e.get("event") == "step" and e["rank"] == rank and e["step"] % H == 0


def scenario(name: str, away: float, max_steps: int, batch_size: int) -> dict:
    from rich.console import Console

    from distributed.hosts.ssh import SSHOptions
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram

    out = Path(tempfile.mkdtemp(prefix=f"elastic-{name}-"))
    events = Events()
    with Testbed(2, subnet="10.213.93", pin=False) as bed:
        cut = bed.hosts[1]
        hosts = bed.hosts_config(free_port(), launcher_is_master=True)
        ssh = SSHOptions(**bed.ssh_settings(connect_timeout=3))
        program = RankProgram.from_profile("digits-diloco", overrides=[
            f"max_steps={max_steps}", f"H={H}", f"batch_size={batch_size}",
            "val_interval=200", "val_size=256",
            "num_threads=1", "checkpoint_interval=None", "num_nodes=3",
            f"output_dir={out / 'run'}"])
        job = Launcher(hosts, program, options=LaunchOptions(
            run_dir=out / "launch", grace_period=2, min_nodes=2),
            ssh=ssh, console=Console(file=_Stamped() if os.environ.get("BENCH_DEBUG") else
                                     StringIO()),
            on_output=_show if os.environ.get("BENCH_DEBUG") else lambda line: None,
            on_event=events)
        result = {}
        with job:
            runner = threading.Thread(target=lambda: result.setdefault("r", job.run()))
            runner.start()
            events.wait(lambda e: e.get("event") == "step" and e["rank"] == 2
                        and e["step"] >= 10 * H, 180)
            t1, e1 = events.wait(round_end(0), 60, after=time.monotonic())
            t2, e2 = events.wait(lambda e: round_end(0)(e) and e["step"] == e1["step"] + H,
                                 60)
            round_s = t2 - t1
            pid = worker_pid(2, str(out))
            outage = HostOutage(bed, cut, 2, str(out))
            if name == "kill":
                hit = outage.hit()
            elif name == "freeze":
                hit = time.monotonic()
                os.kill(pid, signal.SIGSTOP)
            else:
                hit = time.monotonic()
                bed.set_link(cut, up=False)
            t_lost, lost = events.wait(lambda e: e.get("event") == "membership"
                                       and e["ranks"] == [0, 1], 120, after=hit)
            t_round, _ = events.wait(round_end(0), 120, after=t_lost)
            time.sleep(max(0.0, away - (time.monotonic() - hit)))
            if name == "kill":
                outage.back()
            elif name == "freeze":
                os.kill(pid, signal.SIGCONT)
            else:
                bed.set_link(cut, up=True)
            back = time.monotonic()
            # Running again: a new process's start, its readiness, or its admission.
            t_start, _ = events.wait(
                lambda e: (e.get("event") in ("start", "host") and e.get("rank") == 2 and
                           e.get("state", "rejoining") == "rejoining") or
                (e.get("event") == "membership" and e["ranks"] == [0, 1, 2]), 180, after=back)
            t_join, joined = events.wait(lambda e: e.get("event") == "membership"
                                         and e["ranks"] == [0, 1, 2], 180, after=back)
            t_first, _ = events.wait(lambda e: round_end(2)(e) and e["step"] > joined["step"],
                                     120, after=t_join)
            runner.join(timeout=600)
        launch = result["r"]
    losses = [(e["step"], e["val_global_loss"]) for _, e in events.items
              if e.get("event") == "step" and e["rank"] == 0 and "val_global_loss" in e]
    at_hit = [v for s, v in losses if s <= lost["step"]][-1]
    return {"scenario": name, "ok": launch.ok, "round_s": round_s,
            "lost_s": t_round - hit, "declared_s": t_lost - hit,
            "back_s": t_first - back, "joined_s": t_join - back, "started_s": t_start - back,
            "changes": [(m["step"], len(m["ranks"])) for _, m in events.items
                        if m.get("event") == "membership"],
            "val_at_hit": at_hit, "val_final": losses[-1][1]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.elastic_hosts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["kill", "freeze", "link"],
                        choices=["kill", "freeze", "link"])
    parser.add_argument("--away", type=float, default=20.0,
                        help="seconds the host stays away (default 20)")
    parser.add_argument("--max-steps", type=int, default=40000)
    parser.add_argument("--batch-size", type=int, default=256,
                        help="samples per step and rank (default 256: a step of a few ms, "
                             "so the rounds are not all event traffic)")
    args = parser.parse_args()
    missing = check_requirements(pin=False)
    if missing:
        sys.exit("cannot build the test bed:\n  " + "\n  ".join(missing))

    rows = []
    for name in args.scenarios:
        r = scenario(name, args.away, args.max_steps, args.batch_size)
        print(f"{name}: round {r['round_s']:.2f} s, declared lost after {r['declared_s']:.1f} s, "
              f"time lost {r['lost_s']:.1f} s, back to work {r['back_s']:.1f} s after the host "
              f"answered (running after {r['started_s']:.1f} s, admitted after "
              f"{r['joined_s']:.1f} s), membership {r['changes']}, "
              f"val loss {r['val_at_hit']:.4f} -> {r['val_final']:.4f}, ok={r['ok']}",
              flush=True)
        rows.append((name, f"{r['round_s']:.2f} s", f"{r['declared_s']:.1f} s",
                     f"{r['lost_s']:.1f} s", f"{r['back_s']:.1f} s",
                     " -> ".join(str(n) for _, n in r["changes"]),
                     f"{r['val_at_hit']:.4f} -> {r['val_final']:.4f}", r["ok"]))
    print_table(f"hosts that come and go: DiLoCo H={H} on digits, batch {args.batch_size}, "
                f"3 hosts, min_nodes=2, away {args.away:g} s",
                ("scenario", "round", "declared lost", "time lost (target 15 s)",
                 "back to work (target round + 10 s)", "membership", "val loss at hit -> end",
                 "finished"), rows)

if __name__ == "__main__":
    main()
