"""The page of ``replay --web``: the recorded run and its replays, side by side.

One self-contained HTML page (inline SVG, no script, nothing fetched from
elsewhere): the validation loss of the recorded run and of every replay against
time, the time at each step (the two timelines), and the figures' table. It is
written beside the replays (``replay.html``) and served by :class:`PageServer`, the
standard library's HTTP server on 127.0.0.1 by default; bound to any other
address (``0.0.0.0``: the LAN) it requires a random token, given in the printed
URL (``?token=...``), as the live dashboard does, refuses a request whose
``Host`` is not its own address (``guard.py``) and bounds what one peer may cost
it (``connection_limits.py``).
"""

from __future__ import annotations

import hmac
import html
import secrets
import threading
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .connection_limits import BoundedHandler, Limits
from .guard import MISDIRECTED, QuietHTTPServer, host_allowed
from .server import is_loopback

__all__ = ["PageServer", "replay_html"]

#: One colour per series: the recorded run first, then each replay.
COLOURS = ("#222222", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
           "#e377c2", "#17becf")
WIDTH, HEIGHT, PAD = 640, 360, 56


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def _chart(title: str, xlabel: str, ylabel: str,
           series: Sequence[tuple[str, Sequence[tuple[float, float]]]]) -> str:
    """An SVG line chart of ``series`` (name, points), each point marked."""
    points = [p for _, pts in series for p in pts]
    if not points:
        return f"<p>{html.escape(title)}: nothing to draw</p>"
    x0, x1 = min(0.0, min(p[0] for p in points)), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x1 == x0:
        x1 = x0 + 1.0

    def sx(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD)

    def sy(y: float) -> float:
        return HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'role="img" aria-label="{html.escape(title)}">',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-weight="bold">'
             f'{html.escape(title)}</text>',
             f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" '
             'stroke="#888"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#888"/>',
             f'<text x="{WIDTH / 2}" y="{HEIGHT - 12}" text-anchor="middle">'
             f'{html.escape(xlabel)}</text>',
             f'<text x="14" y="{HEIGHT / 2}" text-anchor="middle" transform="rotate(-90 14 '
             f'{HEIGHT / 2})">{html.escape(ylabel)}</text>']
    for x in _ticks(x0, x1):
        parts.append(f'<text x="{sx(x):.1f}" y="{HEIGHT - PAD + 16}" text-anchor="middle" '
                     f'font-size="11">{x:.3g}</text>')
    for y in _ticks(y0, y1):
        parts.append(f'<text x="{PAD - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" '
                     f'font-size="11">{y:.3g}</text>')
    for i, (name, pts) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        dash = ' stroke-dasharray="6 3"' if i else ""
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" data-name="{html.escape(name)}" fill="none" '
                     f'stroke="{colour}" stroke-width="2"{dash} points="{path}"/>')
        for x, y in pts:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}">'
                         f'<title>{html.escape(name)}: {x:.4g}, {y:.4g}</title></circle>')
        parts.append(f'<text x="{WIDTH - PAD + 4}" y="{PAD + 16 * i}" font-size="12" '
                     f'fill="{colour}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _cell(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return html.escape(str(value))


def replay_html(report: Mapping[str, Any], timelines: Mapping[str, Mapping[int, float]]
                ) -> str:
    """The page of a replay's comparison.

    Args:
        report: :meth:`distributed.app.replay.ReplayResult.to_dict`.
        timelines: per series name (``real``, then each replay's label), seconds at each
            step.
    """
    from ..replay.timelines import replayed_change

    real, rep = report["real"], report["replay"]
    curves = [("real", list(zip(real["evaluation_s"], (v for _, v in real["evaluations"])))),
              ("replay", list(zip(rep["evaluation_s"], (v for _, v in rep["evaluations"]))))]
    for row in report.get("what_if") or []:
        if not row["recorded"]:
            times = timelines.get(row["label"], {})
            curves.append((f"what if {row['label']}",
                           [(times[s], v) for s, v in row["evaluations"] if s in times]))
    steps = [(name, sorted((float(s), t) for s, t in times.items()))
             for name, times in timelines.items()]
    ratios = report["ratios"]
    rows = [("total time (s)", real["wall_s"], rep["wall_s"], ratios["wall_s"]),
            ("round, median (s)", real["round_s_median"], rep["round_s_median"],
             ratios["round_s_median"]),
            ("round, 10th-90th percentile (s)",
             f"{_cell(real['round_s_p10'])} - {_cell(real['round_s_p90'])}",
             f"{_cell(rep['round_s_p10'])} - {_cell(rep['round_s_p90'])}", None)]
    replayed = {m["step"]: m for m in rep["membership"]}
    for change in real["membership"]:
        if change["step"] > 1:
            other = replayed_change(replayed, change)
            rows.append((f"lost to step {change['step']}: {change['reason']} (s)",
                         change.get("lost_s"), other.get("lost_s"), None))
    losses = dict((s, v) for s, v in rep["evaluations"])
    for (step, value), (_, ratio) in zip(real["evaluations"], ratios["val_loss"]):
        rows.append((f"val loss at step {step}", value, losses.get(step), ratio))
    table = "\n".join(f"<tr><td>{html.escape(name)}</td><td>{_cell(a)}</td><td>{_cell(b)}</td>"
                      f"<td>{_cell(r)}</td></tr>" for name, a, b, r in rows)
    ranking = ""
    if report.get("what_if"):
        lines = "\n".join(
            f"<tr><td>{row['place']}</td><td>{html.escape(row['label'])}</td>"
            f"<td>{_cell(row['time_to_target_s'])}</td><td>{_cell(row['wall_s'])}</td>"
            f"<td>{_cell(row['final_val_loss'])}</td></tr>" for row in report["what_if"])
        ranking = (f"<h2>What if: time to the recorded final val loss "
                   f"{_cell(report['target_val_loss'])}</h2><table><tr><th>#</th><th>replay"
                   f"</th><th>time to it (s)</th><th>total (s)</th><th>final val loss</th>"
                   f"</tr>{lines}</table><p>- : never reaches it within the run's samples</p>")
    title = f"{report['profile']}: recorded run and replay"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} td:first-child{{text-align:left}}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(report['run_dir'])}: {report['num_nodes']} ranks, {report['steps']} steps,
strategy {html.escape(str(report['strategy']))}, recorded {html.escape(report['source'])}
({html.escape(real['clock'])} clock); replayed on {html.escape(report['cluster']['links_from'])}.</p>
{_chart("validation loss against time", "seconds", "validation loss", curves)}
{_chart("time at each step", "step", "seconds", steps)}
<h2>Real and replay</h2>
<table id="figures"><tr><th></th><th>real</th><th>replay</th><th>replay / real</th></tr>
{table}</table>
{ranking}
</body></html>
"""


class _Handler(BoundedHandler):
    server: PageServer._Server  # type: ignore[name-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - the base's name
        parts = urlsplit(self.path)
        if not host_allowed(self.headers.get("Host"), *self.server.server_address[:2]):
            self.send_response(HTTPStatus.MISDIRECTED_REQUEST)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(MISDIRECTED)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(MISDIRECTED)
            return
        token = self.server.token
        if token is not None:
            given = (parse_qs(parts.query).get("token") or [""])[0]
            if not hmac.compare_digest(given.encode(), token.encode()):
                self.send_error(HTTPStatus.FORBIDDEN, "the page's URL carries a token: use it")
                return
        if parts.path not in ("/", "/index.html"):
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        body = self.server.page.encode("utf-8")
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class PageServer:
    """Serves one page at ``/`` from a daemon thread until :meth:`stop`.

    Args:
        page: the HTML.
        host: the address to bind (127.0.0.1: this machine only).
        port: the port (0: a free one).
        limits: what one peer may cost the server (default: :class:`Limits`' own).

    Raises:
        ValueError: the address cannot be bound.
    """

    class _Server(QuietHTTPServer):
        page = ""
        token: str | None = None

    def __init__(self, page: str, host: str = "127.0.0.1", port: int = 0, *,
                 limits: Limits | None = None) -> None:
        try:
            self._server = self._Server((host, port), _Handler)
        except OSError as exc:
            raise ValueError(f"--web-host {host} --web-port {port} cannot be bound: "
                             f"{exc.strerror or exc}") from None
        self._server.page = page
        self._server.limits = limits or Limits()
        self._server.token = None if is_loopback(host) else secrets.token_urlsafe(16)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where the page is (with ``?token=`` off this machine)."""
        host, port = self._server.server_address[:2]
        if host in ("0.0.0.0", "::"):
            from .server import lan_address

            host = lan_address()
        token = self._server.token
        return f"http://{host}:{port}/" + (f"?token={token}" if token else "")

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
