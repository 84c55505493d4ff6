"""Models the size users train, measured: GPTs of 23M and 124M parameters on synthetic tokens.

Two parts, each printing a table (and, with ``--json``, writing every figure):

``sim``: the same DiLoCo workload simulated with K = 2, 4, 8 ranks on this
machine, by this project and by exo-explore/gym, one after the other in one
run. For each: the wall time of the whole run (start to final model) and the
peak of the summed proportional set size (PSS) of every process of the run,
sampled every 0.2 s. For this project also the training state a rank holds
as accounted before the run (parameters, gradients, optimizer, strategy) and
each rank's measured peak resident memory. exo-explore/gym is not on PyPI
under a usable name (``exogym`` there is an empty placeholder): point
``--gym`` at a checkout of https://github.com/exo-explore/gym (``git clone``
it anywhere); its ``exogym`` is imported from there in a process of its own (it needs
``einops`` installed). gym binds gloo to ``lo0``, macOS's loopback: on Linux
its runs happen in a network namespace that has an interface of that name
(root needed). Without ``--gym`` only this project runs.

``hosts``: three hosts at 1 Gbit/s: this machine (the launcher and rank 0)
and two network namespaces with an sshd each (:mod:`netbed`), every link
shaped with ``tc tbf``. DiLoCo on the 124M model; per run the median round
time, and the sync efficiency of the round's all-reduce: the ring all-reduce's
bound for its bytes at the link rate (``2 (n-1)/n * bytes / rate``) over the
time rank 0 spent in it. Runs: without ``min_nodes``; with ``--min-nodes 2``;
and with ``--min-nodes 2`` where rank 2's host is killed (its sshd stopped, its
rank ``kill -9``) and answers again after ``--away`` seconds: the time to the
returning rank's first trained step ("back to work"; DiLoCo takes it into the
round under way), from the host's answer and from the rank saying it is
ready to come back (its process started), against the state's transfer time
at the link rate plus 5 s.

    sudo python -m bench.real_size sim --gym ../gym
    sudo python -m bench.real_size sim --models 23m --nodes 8 --gym ../gym
    sudo python -m bench.real_size hosts
    sudo python -m bench.real_size sim hosts --gym ../gym --json real_size.json

``hosts`` needs root, iproute2 and sshd (``tests/setup_system.sh``).

Its parts: :mod:`bench.real_size.child` is one measured run in a process of
its own, :mod:`bench.real_size.sim` and :mod:`bench.real_size.hosts` the two
parts, ``__main__`` the command line.
"""

#: The models: the gpt task's settings.
MODELS = {
    "23m": {"vocab_size": 8192, "n_layer": 6, "n_head": 8, "n_embd": 512},
    "124m": {"vocab_size": 50257, "n_layer": 12, "n_head": 12, "n_embd": 768},
}
#: The simulated workload: sequences, batch, steps and DiLoCo's rounds.
SIM = {"block_size": 64, "batch_size": 4, "max_steps": 12, "H": 4, "lr": 6e-4, "tokens": 100_000}
#: The workload across hosts (124M): short sequences, so that a round is mostly its all-reduce.
HOSTS = {"block_size": 64, "batch_size": 1, "max_steps": 12, "H": 2, "tokens": 50_000}
