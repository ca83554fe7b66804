"""Inline SVG line charts for the console: no chart library and nothing fetched at run time.

A series is ``[(unix seconds, value), ...]``; the x axis is time, shared by every series of a chart.
The markup is built with :func:`markupsafe.escape` for the labels and returned as ``Markup``.
"""

from __future__ import annotations

import time

from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 180
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 76, 12, 24, 24
COLOURS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04")

Series = list[tuple[float, float]]


def line_chart(points: Series, *, unit: str, title: str) -> Markup:
    return multi_line_chart({title: points}, unit=unit, title=title)


def _fmt(v: float, unit: str) -> str:
    text = f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.1f}"
    return text + unit


def multi_line_chart(series: dict[str, Series], *, unit: str, title: str) -> Markup:
    points = [p for s in series.values() for p in s]
    head = f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">'
    parts = [head, f'<text x="{PAD_LEFT}" y="14" class="title">{escape(title)}</text>']
    if not points:
        parts.append(f'<text x="{WIDTH // 2}" y="{HEIGHT // 2}" class="empty">no samples yet</text></svg>')
        return Markup("".join(parts))
    t0, t1 = min(p[0] for p in points), max(p[0] for p in points)
    top = max(max(p[1] for p in points), 1e-9) * 1.1
    span = (t1 - t0) or 1.0
    plot_w, plot_h = WIDTH - PAD_LEFT - PAD_RIGHT, HEIGHT - PAD_TOP - PAD_BOTTOM

    def xy(t: float, v: float) -> str:
        return f"{PAD_LEFT + (t - t0) / span * plot_w:.1f},{PAD_TOP + plot_h - v / top * plot_h:.1f}"

    base = PAD_TOP + plot_h
    parts.append(f'<line x1="{PAD_LEFT}" y1="{base}" x2="{WIDTH - PAD_RIGHT}" y2="{base}" class="axis"/>')
    parts.append(f'<line x1="{PAD_LEFT}" y1="{PAD_TOP}" x2="{PAD_LEFT}" y2="{base}" class="axis"/>')
    parts.append(f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + 4}" class="tick" text-anchor="end">')
    parts.append(f"{escape(_fmt(top, unit))}</text>")
    parts.append(f'<text x="{PAD_LEFT - 4}" y="{base}" class="tick" text-anchor="end">0</text>')
    ago = time.time() - t0
    parts.append(
        f'<text x="{PAD_LEFT}" y="{HEIGHT - 6}" class="tick">{escape(_fmt(ago / 60, " min ago"))}</text>'
    )
    parts.append(f'<text x="{WIDTH - PAD_RIGHT}" y="{HEIGHT - 6}" class="tick" text-anchor="end">now</text>')
    legend_x = PAD_LEFT + 16 + 7 * len(title)  # the legend follows the title, clear of the lines
    for i, (name, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        if len(pts) == 1:
            x, y = xy(*pts[0]).split(",")
            parts.append(f'<circle cx="{x}" cy="{y}" r="3" fill="{colour}"/>')
        elif pts:
            coords = " ".join(xy(t, v) for t, v in sorted(pts))
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        if len(series) > 1 or name != title:
            parts.append(f'<text x="{legend_x}" y="14" style="fill:{colour}" class="legend">')
            parts.append(f"{escape(name)}</text>")
            legend_x += 10 + 7 * len(name)
    parts.append("</svg>")
    return Markup("".join(parts))
