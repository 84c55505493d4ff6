"""Ports for the tests (:mod:`netbed.ports`, which the bed's hosts and the benches use too:
it needs only the standard library). Every test takes its ports here."""

from netbed.ports import AVOID, LOWEST, ephemeral_range, free_port

__all__ = ["AVOID", "LOWEST", "ephemeral_range", "free_port"]
