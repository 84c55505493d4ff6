"""onhost: scripts sent to a host as source and run there with its own Python.

Standard library only (a host may have nothing else yet): the rank
supervisor (``bootstrap``) and the pre-flight probe (``probe``). They import
nothing from this project.
"""
