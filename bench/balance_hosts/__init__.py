"""``balance`` on real hosts: two hosts over SSH, one held to half its core by a CPU quota.

Run as root from the project root::

    python -m bench.balance_hosts                     # DiLoCo and DDP, one pass
    python -m bench.balance_hosts --repeat 3          # medians of three passes
    python -m bench.balance_hosts --only diloco --steps 100

The hosts are two network namespaces on one bridge (:mod:`netbed`), each
with its own ``sshd`` pinned to its own core, every link shaped to ``--rate``
(default 1gbit) with ``tc tbf``. Jobs start through the SSH launcher exactly as
``bench.multihost`` starts them (``bench.harness.jobs.Bench`` runs every job): rank 0
in host 0's namespace, rank 1 in host 1's, one compute thread each.

**The slow host.** Before any rank starts, host 1's ``sshd`` is moved into a
child group of the cgroup v1 ``cpu`` controller (``/sys/fs/cgroup/cpu``,
``exobench-<tag>-slow``) with ``cpu.cfs_quota_us`` = ``--slow`` x
``cpu.cfs_period_us`` (50,000 of 100,000 us by default), so every process it
starts (the rank, gloo's threads, the SSH session) inherits half a core.
While a job runs, the script reads each rank's ``/proc/PID/cgroup`` and prints
the group it found; the group's ``cpu.stat`` gives the seconds it was
throttled. The group is removed at the end (its processes moved back to the
root group first), also on errors and SIGINT/SIGTERM.

**The model.** The ``chargpt-bench`` profile (``config.ini``: a character GPT
of 3.3M parameters, one compute thread), about 0.25 s per step of 16 samples
on one core here, so a DiLoCo run of 320 steps takes about a minute and a
half alone and a pass of the bench about 11 minutes; long enough per step that the quota's 100 ms
period slows every step alike rather than some steps fully and others not.
chargpt-bench rather than the digits profiles: a digits step takes a few
milliseconds, which a 100 ms quota period would stall at random.

**Runs**, in this order in each of ``--repeat`` passes (a ratio compares runs
made minutes apart, not on a machine whose speed drifted):

- DiLoCo (H=``--H``, 40), ``--steps`` steps, batch ``--batch-size`` per rank:
  the fast host alone (host 0, one rank), both hosts with ``balance=none``,
  both hosts with ``balance=steps``. A round's average (13 MB each way at
  1gbit, the slow host's part of it held to its quota) costs about 0.3 s, 5%
  of a round of 20 steps; with 40 steps per round, about 2.5%;
- DDP, ``--ddp-steps`` steps, batch ``--ddp-batch`` per rank (128): the fast
  host alone, both hosts with ``balance=none``, both with ``balance=batch``.
  A larger batch than DiLoCo's: DDP all-reduces the whole gradient (13 MB)
  every step, 0.13-0.17 s at 1gbit here, the slow host's share of that work
  held to its quota too; balance moves compute, not that transfer, so the
  compute per step decides how much of the ideal 1.5x is reachable. With 32
  samples per host the transfer was about a fifth of a balanced step and the
  speedup 1.18x; with 64, about a tenth and the speedup 1.24-1.39x over
  three runs; with 128, about a twentieth.

**Definitions.** A *period* is the steps between two communications: a
DiLoCo round (H steps), a DDP step. Ranks meet at its ends, so its wall time
(each rank's training-loop clock, the mean over ranks) is the same for all.

- *Throughput* (samples/s): training samples of all ranks together per second,
  over the periods of the timed window (from the first communication at or
  after ``--warmup`` steps to the last step) that end without an evaluation.
  Samples are each rank's own count: an idle step of ``balance=steps`` trains
  none. An evaluation comes at the end of a period, and the hosts do not pay
  for it alike (the slow host evaluates at half speed, two hosts also
  evaluate the averaged model), so the periods it ends are left out; *eval s*
  is what it added to its period (the median period with one minus the median
  without). *End to end*: all samples over rank 0's loop time to the last
  step, everything included (the first round and its measuring, every
  evaluation).
- *Speedup*: a run's throughput over the fast host alone's (the same profile
  and steps, one rank): the work done per second. Two hosts train two batches
  per step, so steps per second would not compare work. Ideal for hosts of
  speeds 1 and 0.5: 1.5x; with ``balance=none`` the slow host sets the pace,
  about 1.0x.
- *Validation loss per unit of wall time*: every ``--val-every`` steps
  (``--ddp-val-every`` for DDP) and at the end, each run evaluates the average
  of its ranks' models (``val_global_loss``) on the same ``--val-size``
  sequences. Rank 0's curve of (training time, loss), the training time being
  its loop clock less eval s for every evaluation so far, gives *loss @ T1*: a
  run's loss when it had trained as long as the fast host alone did in all
  (T1; interpolated between evaluations; a run that ended sooner: its final
  loss), and *time to L1*: how long a run trains to reach the fast host
  alone's final loss L1 (interpolated; ``-`` if it never does), with
  *speedup to L1* = T1 over it. No worse validation loss per unit of wall
  time: loss @ T1 at most L1, speedup to L1 at least 1.
- Diagnostics: *rank 0 step*, the fast rank's median step inside a DiLoCo
  round (no communication in it): against the fast host alone's, what
  sharing this machine's memory and caches with a busy second host costs
  (real hosts would not pay it); the *launcher*'s own CPU (this process:
  SSH, events) in cores over the job, which no core is set aside for; the
  seconds the slow group was throttled.

With ``--repeat`` every figure is the median over the passes; each pass's
speedups are taken against that pass's fast-host-alone run, and the table
shows their range. Writes ``results.json`` and every job's rank logs
(``logs/``) to ``--out``. Prints figures, asserts nothing. Latency is not
emulated (no ``netem`` in this kernel).

Its parts: :mod:`bench.harness.slow_host` holds the slow host,
:mod:`bench.balance_hosts.runs` measures, :mod:`bench.balance_hosts.report` sums
up, ``__main__`` reads the command line.
"""
