"""Speedup across hosts on bandwidth-limited links: real processes, real SSH, real TCP.

Run as root from the project root::

    python -m bench.multihost                  # 2 hosts, 1gbit/100mbit/20mbit, 5 strategies
    python -m bench.multihost --rates 100mbit --strategies ddp,diloco:100
    python -m bench.multihost --quick          # a small model, one rate, two strategies

What it does:

1. Builds ``--hosts`` hosts as network namespaces on one bridge, every host's
   outgoing link shaped by ``tc tbf`` (:mod:`netbed`), each with its own
   ``sshd``. With pinning (the default), host ``i`` and everything started in
   it runs on core ``i`` alone, and every rank trains with one thread
   (``num_threads=1``), so hosts do not take each other's compute.
2. Measures every link rate: the payload goodput a host gets while sending to
   one peer and receiving from another at once (the ring pattern), the round
   trip, and the protocol overhead (wire bytes over payload bytes).
3. Runs the baselines through the same launcher, on every host at once with
   each host training alone, so that they see the same contention for the
   machine's memory bandwidth and caches as the multi-host runs: the compute
   time per step without communication (AdamW; SPARTA and DeMo with
   ``EXOGYM_COLLECTIVES=mirror``, which does all of their own work per step
   and sends nothing) and the reference, one host doing all ``N`` hosts' work.
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
- **other load**: cores kept busy during the window by processes that are
  not this benchmark's (from ``/proc/stat`` and the ranks' CPU time). Before
  each job it waits until that falls under ``--quiet-cores``.

Latency is not emulated: this kernel has no ``netem``, so links have the
bandwidth they are given and the sub-millisecond delay of a veth.

Its parts: :mod:`bench.multihost.rounds` measures, :mod:`bench.multihost.report`
writes the outputs, ``__main__`` reads the command line.
"""
