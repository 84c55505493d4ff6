"""planning: what a run will cost on given hosts and links.

The projection of step time and speedup, and the measured step time it starts
from. May import profiles, tasks and exogym (torch-free where the faces use it);
never hosts, launch, worker or app.
"""
