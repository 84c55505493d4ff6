#!/usr/bin/env python3
"""Guided set-up, run from a checkout: ``python wizard.py`` is what an installed
``exogym wizard`` is. Finds or builds a hosts file, chooses a profile and a strategy,
writes the files, sets the hosts up and trains.

    python wizard.py                 # asks; uses ./distributed_hosts.json when there is one
    python wizard.py --yes           # takes every default, asks nothing (scripts, CI)

The wizard lives in ``distributed/faces/guided_setup.py``.
"""

from distributed.faces.guided_setup import app

if __name__ == "__main__":
    app()
