"""Script mode: the same script is the driver here and a rank on every host.

    PYTHONPATH=. python tests/scripts/network_fit.py HOSTS_JSON OUT_STATE FIT_JSON

In the driver NetworkTrainer.fit() launches this script on every host of
HOSTS_JSON and returns the final model, saved to OUT_STATE. FIT_JSON holds
``fit``'s arguments (the test trains the simulation with the same). Launcher
options for the test sshd come as JSON in EXOGYM_TEST_LAUNCHER_OPTIONS; the
project is found through PYTHONPATH, here and on the hosts.
"""

import json
import os
import sys

import torch

from distributed import NetworkTrainer
from distributed.tasks.builtin import digits_task
from exogym.strategy import DiLoCoStrategy

if __name__ == "__main__":
    model, train, val = digits_task(seed=0)
    options = json.loads(os.environ.get("EXOGYM_TEST_LAUNCHER_OPTIONS", "{}"))
    trainer = NetworkTrainer(sys.argv[1], model, train, val, launcher_options=options)
    final = trainer.fit(strategy=DiLoCoStrategy(H=10, lr=0.003), **json.loads(sys.argv[3]))
    if trainer.environment is None:
        torch.save(final.state_dict(), sys.argv[2])
