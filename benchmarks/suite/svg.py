"""Small inline SVG charts: horizontal bars and line charts, no dependencies, no scripts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

FONT = 'font-family="system-ui, sans-serif" font-size="11"'


def nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exp:
            return step * exp
    return 10 * exp


def fmt_num(value: float) -> str:
    if value == 0:
        return "0"
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    if value >= 10:
        return f"{value:.0f}"
    if value >= 1:
        return f"{value:.1f}"
    return f"{value:.2f}"


def hbars(rows: Sequence[tuple[str, float, str, str]], *, width: int = 760, unit: str = "msg/s") -> str:
    """``rows``: (label, value, colour, note). One bar per row, the value written at its end."""
    if not rows:
        return ""
    label_w, bar_h, gap, top = 300, 18, 6, 8
    height = top + len(rows) * (bar_h + gap) + 24
    span = width - label_w - 90
    top_value = nice_max(max(v for _, v, _, _ in rows))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" {FONT} role="img">']
    for i in range(5):
        x = label_w + span * i / 4
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{height - 20}" stroke="#e3e3e3"/>')
        parts.append(
            f'<text x="{x:.1f}" y="{height - 6}" text-anchor="middle" fill="#666">{fmt_num(top_value * i / 4)}</text>'
        )
    for i, (label, value, colour, note) in enumerate(rows):
        y = top + i * (bar_h + gap)
        w = max(1.0, span * value / top_value)
        parts.append(
            f'<text x="{label_w - 6}" y="{y + bar_h - 5}" text-anchor="end">{escape(label)}</text>'
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}">'
            f"<title>{escape(label)}: {value:,.0f} {escape(unit)} {escape(note)}</title></rect>"
            f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 5}">{fmt_num(value)} {escape(note)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def line_chart(
    series: Sequence[tuple[str, str, Sequence[tuple[float, float]], bool]],
    *,
    width: int = 760,
    height: int = 260,
    x_label: str = "",
    y_label: str = "",
    log_y: bool = False,
    x_ticks: Sequence[tuple[float, str]] | None = None,
) -> str:
    """``series``: (name, colour, points, dashed). Optional log scale on y; a legend under the plot."""
    points_all = [p for _, _, pts, _ in series for p in pts]
    if not points_all:
        return ""
    left, right, top, bottom = 60, 16, 10, 40
    legend_rows = math.ceil(len(series) / 2)
    full_h = height + legend_rows * 16
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = [p[0] for p in points_all]
    ys = [p[1] for p in points_all]
    x0, x1 = min(xs), max(xs)
    if x1 <= x0:
        x1 = x0 + 1
    if log_y:
        positive = [y for y in ys if y > 0] or [1.0]
        lo = 10 ** math.floor(math.log10(min(positive)))
        hi = 10 ** math.ceil(math.log10(max(positive)))
        if hi <= lo:
            hi = lo * 10

        def ymap(y: float) -> float:
            y = max(y, lo)
            return top + plot_h * (1 - (math.log10(y) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))

        ticks = []
        t = lo
        while t <= hi * 1.0001:
            ticks.append(t)
            t *= 10
    else:
        hi = nice_max(max(ys))

        def ymap(y: float) -> float:
            return top + plot_h * (1 - y / hi)

        ticks = [hi * i / 4 for i in range(5)]

    def xmap(x: float) -> float:
        return left + plot_w * (x - x0) / (x1 - x0)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{full_h}" {FONT} role="img">']
    for t in ticks:
        y = ymap(t)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" fill="#666">{fmt_num(t)}</text>')
    if x_ticks is None:
        x_ticks = [(x0 + (x1 - x0) * i / 5, fmt_num(x0 + (x1 - x0) * i / 5)) for i in range(6)]
    for xv, text in x_ticks:
        x = xmap(xv)
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" stroke="#f0f0f0"/>')
        parts.append(
            f'<text x="{x:.1f}" y="{top + plot_h + 14}" text-anchor="middle" fill="#666">{escape(text)}</text>'
        )
    parts.append(
        f'<text x="{left + plot_w / 2:.0f}" y="{top + plot_h + 30}" text-anchor="middle">{escape(x_label)}</text>'
        f'<text x="12" y="{top + plot_h / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 12 {top + plot_h / 2:.0f})">{escape(y_label)}</text>'
    )
    for name, colour, pts, dashed in series:
        if not pts:
            continue
        path = " ".join(f"{xmap(x):.1f},{ymap(y):.1f}" for x, y in pts)
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        parts.append(
            f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.8"{dash}>'
            f"<title>{escape(name)}</title></polyline>"
        )
        if len(pts) <= 12:
            for x, y in pts:
                parts.append(
                    f'<circle cx="{xmap(x):.1f}" cy="{ymap(y):.1f}" r="3" fill="{colour}">'
                    f"<title>{escape(name)}: {y:,.2f}</title></circle>"
                )
    for i, (name, colour, _, dashed) in enumerate(series):
        lx = left + (i % 2) * (plot_w / 2)
        ly = height + (i // 2) * 16 + 2
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        parts.append(
            f'<line x1="{lx:.0f}" y1="{ly:.0f}" x2="{lx + 18:.0f}" y2="{ly:.0f}" stroke="{colour}" '
            f'stroke-width="2"{dash}/><text x="{lx + 22:.0f}" y="{ly + 4:.0f}">{escape(name[:60])}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)
