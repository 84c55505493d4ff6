"""The simulated network and clock: the cost model of links and collectives, and simulated time."""
