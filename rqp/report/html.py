"""report.html: one self-contained page, charts drawn here as inline SVG.

No scripts, no external style sheets, fonts or images: the page is plain HTML with one inline
``<style>`` and inline ``<svg>`` elements, and its Content-Security-Policy forbids everything
else, so it opens the same from a mail attachment, a file share or an air-gapped machine.
Every piece of text that comes from the data (host and queue names, details, payload previews)
is escaped, and characters that could disguise it (control characters, bidirectional
overrides, zero-width characters) are shown as ``\\uXXXX``.

The input is plain Python data (the job's ``summary`` dict, a :class:`Timeline` and the sample
rows), so this module does not need Spark.

Chart structure (the browser test relies on it): ``<svg id="chart-timeline">`` has one
``<g class="series" data-reason=...>`` per reason with one ``<rect class="bar">`` per time bucket
where that reason has dead letters; ``chart-queues``, ``chart-source-hosts`` and
``chart-destination-hosts`` have one ``<rect class="bar">`` per row.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from dataclasses import dataclass
from html import escape as _escape

__all__ = ["Timeline", "render", "safe_text", "REASON_COLORS"]

#: Fixed colours for the known reasons (so a reason looks the same in every report).
REASON_COLORS = {
    "QUEUE_FULL": "#4e79a7",
    "UNKNOWN_QUEUE": "#f28e2b",
    "NO_ROUTE": "#e15759",
    "NOT_AUTHORIZED": "#76b7b2",
    "MESSAGE_TOO_BIG": "#59a14f",
    "RETRY_BUDGET_EXHAUSTED": "#edc948",
    "QUEUE_NOT_OFFERED": "#b07aa1",
    "PUT_FAILED": "#ff9da7",
    "INVALID_QUEUE_KEY": "#9c755f",
    "MALFORMED_RECORD": "#bab0ac",
    "BAD_MESSAGE_TYPE": "#8cd17d",
    "NO_QUEUE_KEY": "#d37295",
    "MALFORMED": "#86bcb6",
    "NOT_CONFIRMED": "#a0cbe8",
}
_EXTRA_COLORS = ("#499894", "#d4a6c8", "#fabfd2", "#b6992d", "#f1ce63", "#79706e", "#ffbe7d")

_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2069"
                     "\ufeff\ufff9-\ufffb]")


@dataclass(frozen=True)
class Timeline:
    """Dead letters per time bucket and reason: rows of (bucket start ISO string, reason,
    count); buckets are ``bucket_hours`` wide."""

    bucket_hours: int
    rows: tuple[tuple[str, str, int], ...]


def safe_text(value, limit: int | None = None) -> str:
    """``value`` as text fit for HTML: hidden characters made visible, cut to ``limit``
    characters (with an ellipsis), escaped."""
    if value is None:
        return ""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "\u2026"
    text = _HIDDEN.sub(lambda m: "\\u%04x" % ord(m.group()), text)
    return _escape(text, quote=True)


_e = safe_text


def _num(n) -> str:
    if n is None:
        return "-"
    if isinstance(n, float):
        return f"{n:,.1f}"
    return f"{int(n):,}"


def _when(iso: str | None) -> str:
    """'2025-03-03T14:05:06.123456Z' -> '2025-03-03 14:05:06Z'."""
    if not iso:
        return "-"
    return iso.replace("T", " ")[:19] + "Z"


def _parse(iso: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))


def _color_map(reasons) -> dict[str, str]:
    colors, extra = {}, 0
    for reason in reasons:
        if reason in REASON_COLORS:
            colors[reason] = REASON_COLORS[reason]
        else:
            colors[reason] = _EXTRA_COLORS[extra % len(_EXTRA_COLORS)]
            extra += 1
    return colors


def _ticks(vmax: int) -> list[int]:
    """0, step, 2*step, ... up to the first multiple of a round step (1, 2, 5, 10, 20, 25, 50,
    ...) at or above ``vmax``, in at most 6 ticks."""
    step = 1
    for exp in range(0, 19):
        for m in (1, 2, 5) if exp == 0 else (1, 2, 2.5, 5):
            step = int(m * 10 ** exp)
            if step * 5 >= vmax:
                top = -(-max(vmax, 1) // step) * step
                return list(range(0, top + 1, step))
    return [0, vmax]


def _reason_description(reason: str | None) -> str:
    try:
        from rqp.protocol.reasons import ReasonCode
        return ReasonCode[reason].description
    except (KeyError, ImportError, TypeError):
        if reason == "MALFORMED":
            return "the dead-letter record itself could not be read"
        return ""


# ------------------------------------------------------------------------------------------
# Charts
# ------------------------------------------------------------------------------------------

def timeline_chart(timeline: Timeline, reasons: list[str], colors: dict[str, str]) -> str:
    width, height = 1100, 360
    left, right, top, bottom = 64, 16, 16, 56
    plot_w, plot_h = width - left - right, height - top - bottom
    title = (f"Dead letters over time by reason ({timeline.bucket_hours} h buckets, UTC)")
    if not timeline.rows:
        return (f'<svg id="chart-timeline" class="chart" width="{width}" height="80" '
                f'role="img" aria-label="{_e(title)}"><text x="10" y="40">no dead letters'
                f'</text></svg>')
    step = _dt.timedelta(hours=timeline.bucket_hours)
    starts = sorted({_parse(b) for b, _, _ in timeline.rows})
    first, last = starts[0], starts[-1]
    slots = int((last - first) / step) + 1
    totals: dict[_dt.datetime, int] = {}
    cells: dict[str, list[tuple[_dt.datetime, int]]] = {}
    for bucket, reason, count in timeline.rows:
        b = _parse(bucket)
        totals[b] = totals.get(b, 0) + count
        cells.setdefault(reason, []).append((b, count))
    ticks = _ticks(max(totals.values()))
    ymax = ticks[-1]
    slot_w = plot_w / slots
    bar_w = max(slot_w * 0.85, 0.5)
    y = lambda v: top + plot_h - plot_h * v / ymax  # noqa: E731
    out = [f'<svg id="chart-timeline" class="chart" xmlns="http://www.w3.org/2000/svg" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{_e(title)}">', f'<title>{_e(title)}</title>']
    # grid and y labels
    for v in ticks:
        yy = y(v)
        out.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{yy:.1f}" '
                   f'y2="{yy:.1f}"/>')
        out.append(f'<text class="ylabel" x="{left - 6}" y="{yy + 4:.1f}" '
                   f'text-anchor="end">{_num(v)}</text>')
    # x labels: about 8, on bucket boundaries
    every = max(1, math.ceil(slots / 8))
    for s in range(0, slots, every):
        t = first + step * s
        xx = left + s * slot_w
        label = t.strftime("%a %m-%d") if timeline.bucket_hours >= 24 or t.hour == 0 \
            else t.strftime("%m-%d %H:00")
        out.append(f'<line class="tick" x1="{xx:.1f}" x2="{xx:.1f}" y1="{top + plot_h}" '
                   f'y2="{top + plot_h + 5}"/>')
        out.append(f'<text class="xlabel" x="{xx:.1f}" y="{top + plot_h + 18}">'
                   f'{_e(label)}</text>')
    # stacked bars: reasons in the given order, bottom up
    base: dict[_dt.datetime, int] = {}
    for reason in reasons:
        if reason not in cells:
            continue
        out.append(f'<g class="series" data-reason="{_e(reason)}" fill="{colors[reason]}">')
        for b, count in sorted(cells[reason]):
            below = base.get(b, 0)
            base[b] = below + count
            s = int((b - first) / step)
            x0 = left + s * slot_w + (slot_w - bar_w) / 2
            y_top, y_bottom = y(below + count), y(below)
            out.append(
                f'<rect class="bar" x="{x0:.2f}" y="{y_top:.2f}" width="{bar_w:.2f}" '
                f'height="{max(y_bottom - y_top, 0.0):.2f}" data-count="{count}">'
                f'<title>{_e(_when(b.isoformat().replace("+00:00", "Z")))} {_e(reason)}: '
                f'{_num(count)}</title></rect>')
        out.append('</g>')
    out.append(f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" '
               f'y2="{top + plot_h}"/>')
    out.append('</svg>')
    legend = ['<ul class="legend">']
    for reason in reasons:
        if reason in cells:
            legend.append(f'<li><span class="swatch" style="background:{colors[reason]}">'
                          f'</span>{_e(reason)}</li>')
    legend.append('</ul>')
    return "".join(out) + "".join(legend)


def hbar_chart(chart_id: str, title: str, items: list[tuple[str, int]],
               color: str = "#4e79a7") -> str:
    """Horizontal bars, one per (label, count), largest first as given."""
    width, row_h, label_w, right = 1100, 24, 330, 90
    height = max(row_h * len(items) + 16, 40)
    plot_w = width - label_w - right
    out = [f'<svg id="{_e(chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{_e(title)}"><title>{_e(title)}</title>']
    if not items:
        out.append('<text x="10" y="25">none</text></svg>')
        return "".join(out)
    vmax = max(c for _, c in items) or 1
    for i, (label, count) in enumerate(items):
        yy = 8 + i * row_h
        w = max(plot_w * count / vmax, 1.0)
        out.append(f'<text class="blabel" x="{label_w - 8}" y="{yy + 15}" text-anchor="end">'
                   f'{_e(label, 48)}</text>')
        out.append(f'<rect class="bar" x="{label_w}" y="{yy + 3}" width="{w:.2f}" '
                   f'height="{row_h - 6}" fill="{color}" data-count="{count}">'
                   f'<title>{_e(label)}: {_num(count)}</title></rect>')
        out.append(f'<text class="bvalue" x="{label_w + w + 6:.2f}" y="{yy + 15}">'
                   f'{_num(count)}</text>')
    out.append('</svg>')
    return "".join(out)


# ------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------

def _table(table_id: str, headers: list[str], rows: list[list[str]],
           numeric: set[int] = frozenset()) -> str:
    """``rows`` are already-escaped cell contents."""
    head = "".join(f'<th{" class=num" if i in numeric else ""}>{_e(h)}</th>'
                   for i, h in enumerate(headers))
    body = "".join(
        "<tr>" + "".join(f'<td{" class=num" if i in numeric else ""}>{c}</td>'
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    if not rows:
        body = f'<tr><td colspan="{len(headers)}">none</td></tr>'
    return f'<table id="{_e(table_id)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _queue_label(row: dict) -> str:
    name = row.get("queue_name")
    key = row.get("queue_key_hex") or (
        "0x%08x" % row["queue_key"] if row.get("queue_key") is not None else "(none)")
    return f"{name} ({key})" if name else str(key)


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;
max-width:1140px;color:#1d1d1f;background:#fff;padding:0 12px}
h1{font-size:24px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid
#ddd;padding-bottom:4px}p.meta{color:#555;margin:0 0 12px}
dl.totals{display:grid;grid-template-columns:repeat(4,1fr);gap:8px;margin:12px 0}
dl.totals div{background:#f4f6f9;border-radius:6px;padding:8px 12px}
dl.totals dt{color:#555;font-size:12px}dl.totals dd{margin:0;font-size:20px;font-weight:600}
table{border-collapse:collapse;width:100%;margin:8px 0;font-size:13px}
th,td{border-bottom:1px solid #e3e3e3;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f6f9}td:first-child{white-space:nowrap}td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
pre.preview{margin:0;white-space:pre-wrap;word-break:break-all;background:#f7f7f7;
padding:4px 6px;border-radius:4px;font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;
max-width:520px}
svg.chart{display:block;margin:8px 0;font:11px system-ui,sans-serif}
svg .grid{stroke:#e6e6e6}svg .axis,svg .tick{stroke:#888}svg .xlabel{fill:#444}
svg .ylabel,svg .blabel,svg .bvalue{fill:#333}
ul.legend{list-style:none;padding:0;margin:4px 0 0;display:flex;flex-wrap:wrap;gap:4px 16px}
ul.legend li{font-size:12px}span.swatch{display:inline-block;width:10px;height:10px;
margin-right:5px;border-radius:2px;vertical-align:-1px}
.note{color:#555;font-size:13px}
"""


def render(summary: dict, timeline: Timeline, samples: list[dict]) -> str:
    """The whole page."""
    totals = summary["totals"]
    by_reason = summary["by_reason"]
    reasons = [r["reason"] for r in by_reason]
    reasons += sorted({r for _, r, _ in timeline.rows} - set(reasons), key=str)
    colors = _color_map(reasons)
    parts: list[str] = []
    add = parts.append
    add('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">')
    add('<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        'style-src \'unsafe-inline\'; img-src data:">')
    add('<meta name="viewport" content="width=device-width, initial-scale=1">')
    add(f'<title>RQP dead-letter report: {_num(totals["dead_letters"])} dead letters</title>')
    add(f'<style>{_CSS}</style></head><body>')
    add('<h1>RQP dead-letter report</h1>')
    add(f'<p class="meta">Generated {_e(_when(summary.get("generated_at")))} from '
        f'{_e(", ".join(summary.get("inputs", [])), 300)}. Dead letters from '
        f'{_e(_when(summary.get("first_seen")))} to {_e(_when(summary.get("last_seen")))} '
        f'(UTC).</p>')
    cards = [
        ("total-dead-letters", "dead letters", _num(totals["dead_letters"])),
        ("total-lines", "archive lines read", _num(totals["lines"])),
        ("total-duplicates", "duplicate ids dropped", _num(totals["duplicates_dropped"])),
        ("total-unreadable", "unreadable lines", _num(totals["unreadable_lines"])),
        ("total-files", "archive files", _num(totals["files"])),
        ("total-queues", "queues", _num(totals["queues"])),
        ("total-source-hosts", "source hosts", _num(totals["source_hosts"])),
        ("total-destination-hosts", "destination hosts", _num(totals["destination_hosts"])),
        ("total-recoverable", "likely recoverable", _num(totals["likely_recoverable"])),
        ("first-seen", "first seen", _when(summary.get("first_seen"))),
        ("last-seen", "last seen", _when(summary.get("last_seen"))),
        ("total-reasons", "reasons", _num(totals["reasons"])),
    ]
    add('<dl class="totals" id="totals">')
    for ident, label, value in cards:
        add(f'<div><dt>{_e(label)}</dt><dd id="{ident}">{_e(value)}</dd></div>')
    add('</dl>')

    add('<h2>Dead letters over time</h2>')
    add(timeline_chart(timeline, reasons, colors))

    add('<h2>By reason</h2>')
    add(_table("table-reasons", ["reason", "dead letters", "share", "first seen", "last seen",
                                 "meaning"],
               [[f'<span class="swatch" style="background:{colors.get(r["reason"], "#999")}">'
                 f'</span>{_e(r["reason"])}', _num(r["count"]),
                 f'{100 * r.get("share", 0):.1f}%', _e(_when(r["first_seen"])),
                 _e(_when(r["last_seen"])), _e(_reason_description(r["reason"]))]
                for r in by_reason], numeric={1, 2}))

    add(f'<h2>Top destination queues</h2><p class="note">{_num(totals["queues"])} queue keys '
        f'in all; the {min(len(summary["top_queues"]), totals["queues"])} with the most dead '
        f'letters.</p>')
    add(hbar_chart("chart-queues", "Dead letters per destination queue",
                   [(_queue_label(q), q["count"]) for q in summary["top_queues"]]))
    add(_table("table-queues", ["queue key", "name", "dead letters", "first seen", "last seen"],
               [[_e(q.get("queue_key_hex")), _e(q.get("queue_name") or "-"), _num(q["count"]),
                 _e(_when(q["first_seen"])), _e(_when(q["last_seen"]))]
                for q in summary["top_queues"]], numeric={2}))

    add('<h2>Top hosts</h2>')
    add(f'<p class="note">Source host: where the message was sent from. {_num(totals["source_hosts"])} '
        f'in all.</p>')
    add(hbar_chart("chart-source-hosts", "Dead letters per source host",
                   [(h["source"], h["count"]) for h in summary["top_source_hosts"]],
                   color="#59a14f"))
    add(f'<p class="note">Destination host: where it was going ("(unknown)" when the record '
        f'does not say). {_num(totals["destination_hosts"])} in all.</p>')
    add(hbar_chart("chart-destination-hosts", "Dead letters per destination host",
                   [(h["destination"], h["count"]) for h in summary["top_destination_hosts"]],
                   color="#f28e2b"))

    add('<h2>By message type</h2>')
    add(_table("table-message-types", ["message type", "dead letters", "first seen",
                                       "last seen"],
               [[_e(m["message_type"]), _num(m["count"]), _e(_when(m["first_seen"])),
                 _e(_when(m["last_seen"]))] for m in summary["by_message_type"]],
               numeric={1}))

    add('<h2>Payload sizes</h2><p class="note">original_length in bytes (before any '
        'truncation); p50 and p95 are approximate percentiles.</p>')
    add(_table("table-payload", ["reason", "count", "min", "max", "avg", "p50", "p95"],
               [[_e(p["reason"]), _num(p["count"]), _num(p["min"]), _num(p["max"]),
                 _num(p["avg"]), _num(p["p50"]), _num(p["p95"])]
                for p in summary["payload_stats"]], numeric={1, 2, 3, 4, 5, 6}))

    rec = summary["likely_recoverable"]
    if rec["evidence"] == "traffic":
        why = ("Evidence: traffic data. These dead letters' queues received deliveries after "
               "they were dead-lettered (reasons that are a property of the message itself, "
               "such as MESSAGE_TOO_BIG, are left out).")
    else:
        why = ("Evidence: the reason only (no traffic data given). These dead letters have a "
               "transient reason (QUEUE_FULL, UNKNOWN_QUEUE, NO_ROUTE, QUEUE_NOT_OFFERED): "
               "likely recoverable once the cause is fixed. Give --traffic for evidence that "
               "their queues worked later.")
    add(f'<h2>Likely recoverable</h2><p class="note" id="recoverable-evidence">{_e(why)}</p>')
    add(_table("table-recoverable", ["reason", "evidence", "dead letters"],
               [[_e(r["reason"]), _e(r["evidence"]), _num(r["count"])]
                for r in rec["by_reason"]], numeric={2}))

    rank = {r: i for i, r in enumerate(reasons)}
    samples = sorted(samples, key=lambda s: (rank.get(s.get("reason"), len(rank)),
                                             str(s.get("reason"))))
    add('<h2>Samples</h2><p class="note">The earliest dead letter of each reason.</p>')
    add(_table("table-samples", ["reason", "id / time", "queue", "route", "detail",
                                 "payload preview"],
               [[_e(s.get("reason")),
                 f'<code class="sample-id">{_e(s.get("id"))}</code><br>'
                 f'{_e(_when(s.get("timestamp")))}',
                 _e(_queue_label(s)),
                 f'{_e(s.get("source"))} &rarr; {_e(s.get("destination"))}<br>'
                 f'{_e(s.get("agent"))}, {_e(s.get("message_type"))}, '
                 f'{_num(s.get("original_length"))} B',
                 _e(s.get("detail"), 200),
                 f'<pre class="preview">{_e(s.get("payload_preview"), 200)}</pre>'
                 if s.get("payload_preview") else '<span class="note">(no payload)</span>']
                for s in samples]))
    add('<p class="note">Every table is also under parquet/ and csv/ beside this page; '
        'summary.json has the totals.</p>')
    add('</body></html>\n')
    return "".join(parts)
