"""rank: what runs on a host as one rank.

The worker (``python -m distributed.worker``), the rank side of
NetworkTrainer, and the wire facts both ends agree on (rank variables, the
final model's name). May import profiles, hosts, tasks and exogym; never
launch or app: a rank does not know how it was started.
"""
