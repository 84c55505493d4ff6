"""Script mode: the same script is the driver here and a rank on every host.

    python tests/scripts/network_fit.py HOSTS_JSON OUT_STATE

In the driver NetworkTrainer.fit() launches this script on every host of
HOSTS_JSON and returns the final model, saved to OUT_STATE. Launcher options
for the test sshd come as JSON in EXOGYM_TEST_LAUNCHER_OPTIONS.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from distributed import NetworkTrainer  # noqa: E402
from distributed.tasks.builtin import digits_task  # noqa: E402
from exogym.strategy import DiLoCoStrategy  # noqa: E402

FIT = dict(max_steps=30, batch_size=32, val_size=64, val_interval=10, num_threads=1,
           logger=None, progress=False, seed=0)

if __name__ == "__main__":
    model, train, val = digits_task(seed=0)
    options = json.loads(os.environ.get("EXOGYM_TEST_LAUNCHER_OPTIONS", "{}"))
    trainer = NetworkTrainer(sys.argv[1], model, train, val, launcher_options=options)
    final = trainer.fit(strategy=DiLoCoStrategy(H=10, lr=0.003), **FIT)
    if trainer.environment is None:
        torch.save(final.state_dict(), sys.argv[2])
