"""web: the dashboard in the browser (``--web``).

``state.py`` keeps the runs' rows and chart points, ``server.py`` serves the
page (``static/``), ``/state`` and ``/events`` with the standard library and
is the progress sink the runs feed, ``page_lifetime.py`` opens it for a command and
keeps it serving after the run while a person looks, ``guard.py`` refuses
requests addressed to another name (DNS rebinding) and keeps closed connections quiet,
``connection_limits.py`` bounds what one peer may cost the server (connections, time, bytes). Standard
library only,
no torch; plotly.js comes from the installed ``plotly`` package (the ``web`` extra).
"""

from .page_lifetime import keep_serving, open_web
from .server import WEB_EXTRA_HINT, WebDashboard, plotly_js_path

__all__ = ["WEB_EXTRA_HINT", "WebDashboard", "keep_serving", "open_web", "plotly_js_path"]
