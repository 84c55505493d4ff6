"""Asynchronous DiLoCo against synchronous DiLoCo on real hosts: one slow, one lost and back.

Run as root from the project root::

    python -m bench.async_hosts                       # both runs, 6-15 minutes
    python -m bench.async_hosts --slow 0.1 --steps 120 --kill-at 35
    python -m bench.async_hosts --fast 0.7 --slow 0.35 --adaptive-H
    python -m bench.async_hosts --report runs/async-hosts/results.json --target 2.87

**The hosts.** Three network namespaces on one bridge (:mod:`netbed`), each
with its own ``sshd``, every link shaped to ``--rate`` (100mbit) with ``tc
tbf``. The runs use ``min_nodes=2``, which needs the launcher on the master host
(the rendezvous store lives in it), so the launcher runs inside host 0's
namespace beside rank 0 (:mod:`bench.harness.elastic_job`); ranks 1 and 2 start
over SSH on hosts 1 and 2. Nothing is pinned: the three ranks share this
machine's cores (each within its quota with ``--fast``).

- **A slow host**: host 1's ``sshd`` is moved into a cgroup v1 ``cpu`` group
  with ``cpu.cfs_quota_us`` = ``--slow`` x 100,000 us (50,000 by default), so
  rank 1, started by it, has half a core (:mod:`bench.harness.slow_host`).
- **Hosts with cores of their own** (``--fast F``): hosts 0 and 2 are held to
  F of a core each as well (the launcher's process joins host 0's group before
  it starts rank 0; host 2's sshd joins its group again when it is back), so
  that the fast ranks neither share the machine's cores nor get a core freed by
  a rank that waits, as on machines of their own. On two cores,
  ``--fast 0.7 --slow 0.35`` is one host at half the speed of the others,
  scaled to fit; the bench checks that each held rank runs in its group.
- **A lost host**: at ``--kill-at`` seconds on rank 0's training clock (from the
  start of its loop, which its step events' ``wall_s`` count from), whatever
  step it is at, host 2's ``sshd`` is stopped and its rank killed
  with ``kill -9``; ``--away`` seconds later the sshd is started again, the
  launcher's probe reaches the host and starts rank 2 anew, and the ranks
  readmit it at a round boundary (:mod:`bench.harness.outage`). The same moment
  and the same delay in both runs.

**The runs**, on the ``chargpt-bench`` profile (a character GPT of 3.3M
parameters, ``config.ini``; one compute thread, batch ``--batch-size`` 16, lr
0.001), the same ``H`` (``--H``, 20), outer optimizer (SGD, lr 0.7, Nesterov
0.9) and seed:

- synchronous DiLoCo (``strategy=diloco``), ``--steps`` steps (200): every
  round waits for the slowest rank;
- asynchronous DiLoCo (``strategy=async_diloco``, ``quorum`` ``--quorum`` 0.5:
  2 of 3 workers present, 1 of 2 while host 2 is away; ``grace_s`` 0,
  ``max_staleness`` 4, ``weighting=tokens``), ``--async-steps`` steps (default
  1.5 x ``--steps``: its slow rank idles at some steps, so a step trains fewer
  samples; the run is timed to its target, not to its end): each rank trains
  its rounds at its own measured pace.

Steps count the run's clock in both (``max_steps``, ``val_interval``); under
AsyncDiLoCo a slow rank idles at some of them, so the same steps take less wall
time and train fewer samples.

**Figures**, per run:

- *validation loss*: every ``--val-every`` steps and at the end each run scores
  its global model (``val_global_loss``: DiLoCo's average of the ranks' models,
  AsyncDiLoCo's global model) on the same ``--val-size`` sequences; the curve is
  (rank 0's ``wall_s``, loss). Rank 0 is never lost, and its clock starts when
  its training loop does, so start-up is not counted;
- *target*: ``--target``, or by default the synchronous run's final validation
  loss; *time to target*: the first wall time the curve reaches it (linear
  between evaluations; ``-`` if it never does). *Ratio*: the synchronous run's
  time to target over the asynchronous run's (the project's target: >= 1.2x);
- *wall time*: rank 0's clock at its last step; *samples*: what each rank trained;
- *merges* (AsyncDiLoCo, from ``summary.json``'s ``merges``): versions, merged
  and dropped contributions and their steps, staleness; for DiLoCo its rounds;
- *membership*: its changes (step, ranks) from ``summary.json``, and when rank 2
  was readmitted: seconds after its host answered again, and the step;
- diagnostics: each rank's median compute per trained step (which rank really
  set the pace), the seconds the slow host's group was throttled by its quota,
  and the cores other processes kept busy from the run's first step to the
  kill (``bench.harness.machine``). Before each run the bench waits, up to
  ``--wait-max`` seconds in all, until others keep fewer than ``--quiet-cores``
  busy. On a machine whose other load leaves each rank less than the quota,
  the quota never binds: the throttled seconds say so.

Writes ``results.json`` and every run's launcher and rank logs to ``--out``.
Prints figures, asserts nothing. Whatever happens (an error, Ctrl-C, SIGTERM),
the launcher, the ranks, the sshds, the namespaces and the cpu group are removed.

Its parts: :mod:`bench.async_hosts.runs` runs and measures one run, ``__main__``
reads the command line, builds the bed and prints the comparison.
"""
