"""Speedup across hosts on bandwidth-limited links: real processes, real SSH, real TCP.

Run as root from the project root::

    python -m bench.multihost                  # 2 hosts; 1gbit, 100mbit; DDP, DiLoCo,
                                               # Streaming DiLoCo, SparseLoCo
    python -m bench.multihost --hosts 4 --share 0.45 --rates 100mbit --strategies diloco:100
    python -m bench.multihost --hosts 3 --quick --share 0.5   # a small model, short windows
    python -m bench.multihost --hosts 6 --plan  # the share and every job's settings, no run

What it does:

1. Builds ``--hosts`` hosts as network namespaces on one bridge, every host's
   outgoing link shaped by ``tc tbf`` (:mod:`netbed`), each with its own
   ``sshd``. Every host is held to ``--share`` of a core by a cgroup v1 ``cpu``
   group of its own (:func:`bench.harness.slow_host.held_hosts`: its sshd is
   moved in, so the SSH sessions, rank supervisors and ranks it starts are born
   there; the bench checks each job's ranks ran in their host's group), and
   every rank trains with one thread (``num_threads=1``), so hosts that
   outnumber the cores still never take each other's compute. The default
   share is the largest equal one that leaves a quarter core to the launcher,
   ``min(1, (cores - 0.25) / N)`` rounded down to 0.05; shares under 0.25 core
   (a quota that stalls steps) and shares that add up to more than the cores
   are refused. ``--pin`` also pins host ``i`` to core ``i``.
2. Measures every link rate, each host's probe in its group: the payload
   goodput a host gets while sending to one peer and receiving from another at
   once (the ring pattern), the round trip, and the protocol overhead (wire
   bytes over payload bytes).
3. Runs the baselines through the same launcher, on every host at once with
   each host training alone, so that they see the same contention for the
   machine's memory bandwidth and caches as the multi-host runs: the compute
   time per step without communication (AdamW; SPARTA and DeMo with
   ``EXOGYM_COLLECTIVES=mirror``, which does all of their own work per step
   and sends nothing) and the reference, one host doing all ``N`` hosts' work,
   at the same share.
4. For every rate and strategy, runs the profile (``chargpt-bench`` in
   ``config.ini``) through the real launcher, every rank over SSH, rank 0 in
   host 0's namespace.
5. Writes ``results.json``, ``table.md`` and ``speedup.png`` (atomically), and
   removes every namespace, link and process it created, also on SIGINT/SIGTERM.

Definitions:

- **time per step**: for each rank, the wall time (``wall_s`` of its step
  events) from step ``s0`` to step ``s1``, divided by ``s1 - s0``; averaged
  over ranks. ``s0`` is the first communication at or after ``--warmup``
  steps and ``s1`` a later one: the window holds whole communication periods
  (DiLoCo's ``H``), at least ``--periods`` of them and ``--window`` steps, and
  ranks, which run freely between communications, meet at both ends. The
  final evaluation comes after it.
- **comm share**: ``1 - t_compute / t_step``, with ``t_compute`` the same
  training with every host on its own (AdamW alone for DDP and DiLoCo; SPARTA
  and DeMo with mirrored collectives, so their local work per step is
  compute), measured just before the runs of each rate (this machine's speed
  drifts from minute to minute). It counts everything a step spends beyond
  that: transfers, waiting for the slower peer, DiLoCo's outer step.
- **wire bytes**: per host and step, the bytes the hosts' veths sent during
  the window (``ip -s link`` in each namespace), minus what went to the
  launcher (SSH output), divided by hosts and steps: payload, TCP/IP headers,
  acknowledgements, heartbeats. **formula**: the strategy's payload per host
  and step (``distributed.projection.bytes_per_step``); **wire / expected**
  divides the wire bytes by formula x (1 + the link's measured protocol overhead).
- **speedup**: the reference's time per step over the strategy's, i.e. the
  throughput of ``N`` hosts over that of one host doing the same total work at
  the same settings: each step, one host processes the ``N`` minibatches of
  ``batch_size`` samples the ``N`` hosts process, one after the other
  (``minibatch_size = batch_size``, gradient accumulation), with AdamW.
- **loss**: the validation loss of the ranks' averaged model after the last
  step, and the training loss averaged over the window's last 10 steps.
- **time to target**: seconds of training (each rank's clock less the time its
  evaluations took, :func:`bench.harness.timing.training_clock`) until the
  validation loss of the ranks' averaged model, evaluated every
  ``--val-every`` steps, first reaches ``--target-loss`` (linear between
  evaluations; default: the reference's validation loss at the end of its
  window, its own model's); **speedup to target** is the reference's time to it
  over the run's. The evaluations inside a window are left out of its time per
  step and of its wire bytes (their traffic measured, :mod:`bench.harness.jobs`).
  **predicted**: the steps the run took to the target times the projection's
  time per step (for the reference: its steps times ``N`` minibatches).
- **other load**: cores kept busy during the window by processes that are
  not this benchmark's (from ``/proc/stat`` and the ranks' CPU time). Before
  each job it waits until that falls under ``--quiet-cores``.

Latency is not emulated: this kernel has no ``netem``, so links have the
bandwidth they are given and the sub-millisecond delay of a veth.

Its parts: :mod:`bench.multihost.rounds` measures (:mod:`bench.multihost.links` the
links), :mod:`bench.multihost.report` writes the outputs, ``__main__`` reads the command
line.
"""
