"""What the benches share, so that none keeps a copy of its own.

- :mod:`bench.harness.timing`: the window of steps a bench times, medians over
  repeats, a loss curve against the clock, a child process timed;
- :mod:`bench.harness.tables`: tables in the terminal (rich) and in markdown;
- :mod:`bench.harness.machine`: what this machine's processes use (CPU, memory);
- :mod:`bench.harness.jobs`: a profile launched on the network-namespace bed's
  hosts and what its step events say;
- :mod:`bench.harness.session`: a bench's life on the bed: its options, the bed
  built and always taken down, Ctrl-C;
- :mod:`bench.harness.strategies`: strategies as the benches write them (``diloco:100``);
- :mod:`bench.harness.slow_host`: a bed host held to part of its core;
- :mod:`bench.harness.outage`: a bed host lost (sshd stopped, rank killed) and back;
- :mod:`bench.harness.elastic_job`: a ``min_nodes`` job with the launcher in host 0's
  namespace, so that every rank runs in a bed host.

The bed itself is :mod:`netbed` (the project root), which the tests use too.
"""

from pathlib import Path

#: The project root: the benches run from here, and their children too.
ROOT = Path(__file__).resolve().parents[2]
