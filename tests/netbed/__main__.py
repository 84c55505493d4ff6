"""``python -m tests.netbed``: hosts apart started by hand (:func:`netbed.apart.main`)."""

from .apart import main

raise SystemExit(main())
