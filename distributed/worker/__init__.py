"""worker: the program a host runs for one rank, ``python -m distributed.worker``.

Its command line (``__main__``, written once in ``command``), running a
profile's rank or its simulation (``run_profile``), the rank side of
NetworkTrainer (``rank_trainer``), and the wire facts both ends agree on (rank
variables, SLURM's variables, the final model's name). May import profiles,
hosts, tasks and exogym; never launch or app: a rank does not know how it was
started.
"""
