"""``python -m distributed.worker --profile NAME``: one rank of a profile, or its simulation.

The command line hosts, torchrun and SLURM run; the worker itself is
:mod:`distributed.worker.run_profile`.
"""

import sys

from .run_profile import main

if __name__ == "__main__":
    sys.exit(main())
