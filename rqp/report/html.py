"""report.html: one self-contained page, charts drawn here as inline SVG.

No external style sheets, fonts, images or scripts: the page is HTML with one inline
``<style>``, inline ``<svg>`` elements and one small inline ``<script>`` (the filters), so it
opens the same from a mail attachment, a file share or an air-gapped machine. Its
Content-Security-Policy allows that one script by its SHA-256 hash (:data:`SCRIPT_HASH`) and
nothing else: no other inline script, no ``eval``, no event-handler attributes, no network.
A hash rather than a nonce because the page is a file, written once: a nonce protects
nothing when it is in the same file as the script. Every piece of text that comes from the
data (host and queue names, details, payload previews) is escaped, and characters that could
disguise it (control characters, bidirectional overrides, zero-width characters) are shown as
``\\uXXXX``; data reaches the script only as JSON in escaped ``data-f`` attributes, parsed
with ``JSON.parse``, and is shown by it only through ``textContent``.

Filters: a host, a queue and a reason can be chosen at the top (also from the address:
``report.html#host=vm&reason=QUEUE_FULL``). An element that carries a dimension (its
``data-f`` says which: ``{"host": [...], "queue": "0x...", "reason": "..."}``, a list meaning
any of them) is hidden when it does not match; the timeline is stacked again from what is
left. "Host" matches where the dead letter was dead-lettered, its source or its destination,
as ``rqpctl dlq replay``'s ``host:`` does. Charts and tables without a dimension (e.g. the
reasons table under a host filter) are not narrowed by it: the breakdown table (reason x queue
x host) is, and the page says how many dead letters match. With scripts off the page is the
same without the controls (``hidden`` until the script runs): every row and bar shown.

Colours: the timeline uses Paul Tol's "muted" palette (:data:`PALETTE`), nine colours chosen
to stay distinct for colour-blind readers and in print. Reasons are coloured in their order in
this report (most dead letters first); with more than nine reasons the first eight keep a
colour and the rest are stacked as one grey "other" series (:data:`OTHER_COLOR`) whose legend
names them: a tenth colour would be one no reader can tell apart. Filtering to one of them
shows it alone.

The input is plain Python data (the job's ``summary`` dict, a :class:`Timeline`, the sample
rows and the breakdown rows), so this module does not need Spark.

Chart structure (the browser test relies on it): ``<svg id="chart-timeline">`` has one
``<g class="series" data-reason=...>`` per coloured reason (then, with more than nine, one
``series other`` and a hidden ``series tail`` per grouped reason) with one
``<rect class="bar">`` per time bucket where that reason has dead letters; ``chart-queues``,
``chart-source-hosts``, ``chart-destination-hosts`` (and the trends' ``chart-queues-jumped``,
``chart-hosts-growing``) have one ``<rect class="bar">`` per row, in a ``<g class="row">``.
Each reason has an anchor ``reason-N`` (its row), ``sample-N`` (its sample) and ``rule-N``
(its replay rule), N its place in the reasons table.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import math
import re
from dataclasses import dataclass
from html import escape as _escape

from rqp.report import rules as _rules

__all__ = ["Timeline", "render", "safe_text", "PALETTE", "OTHER_COLOR", "SCRIPT",
           "SCRIPT_HASH", "CSP", "BREAKDOWN_ROWS"]

#: Paul Tol's "muted" qualitative palette (https://personal.sron.nl/~pault/): distinct for
#: colour-blind readers, for up to nine categories.
PALETTE = ("#cc6677", "#332288", "#ddcc77", "#117733", "#88ccee", "#882255", "#44aa99",
           "#999933", "#aa4499")
#: The grey of the reasons grouped as "other" (more reasons than colours).
OTHER_COLOR = "#bbbbbb"
#: At most this many rows of the breakdown (reason x queue x host) go into the page (the
#: largest; the whole table is under parquet/ and csv/).
BREAKDOWN_ROWS = 1000

_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2069"
                     "\ufeff\ufff9-\ufffb]")


@dataclass(frozen=True)
class Timeline:
    """Dead letters per time bucket and reason: rows of (bucket start ISO string, reason,
    count); buckets are ``bucket_hours`` wide."""

    bucket_hours: int
    rows: tuple[tuple[str, str, int], ...]


#: Files left out named on the page (summary.json has them all).
LEFT_OUT_SHOWN = 20


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


def _middle(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters in its middle: a path keeps its file name (a
    re-check's long path lost it, cut at its end)."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head] + "\u2026" + text[len(text) - (limit - head - 1):]


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


def _color_map(reasons: list) -> tuple[dict, list]:
    """Each reason's colour (in the given order, see the module docstring) and the reasons
    grouped as "other" (none unless there are more reasons than :data:`PALETTE` colours)."""
    shown = list(reasons) if len(reasons) <= len(PALETTE) else list(reasons)[:len(PALETTE) - 1]
    colors = {reason: PALETTE[i] for i, reason in enumerate(shown)}
    tail = [reason for reason in reasons if reason not in colors]
    colors.update({reason: OTHER_COLOR for reason in tail})
    return colors, tail


def _f(**dims) -> str:
    """The ``data-f`` attribute of a filterable element (see the module docstring)."""
    text = json.dumps(dims, ensure_ascii=True, separators=(",", ":"), default=str)
    return f' data-f="{_e(text)}"'


def _value(v) -> str:
    """A filter option's value: the name as JSON, the same text the ``data-f`` values parse
    from, whatever characters the name has."""
    return _e(json.dumps(v, ensure_ascii=True))


def _queue_id(row: dict) -> str:
    return row.get("queue_key_hex") or (
        "0x%08x" % row["queue_key"] if row.get("queue_key") is not None else "(none)")


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

def timeline_chart(timeline: Timeline, reasons: list, colors: dict, tail: list = ()) -> str:
    """Stacked bars per time bucket, one series per reason in ``reasons`` order (bottom up);
    the ``tail`` reasons stacked as one "other" series, and each also drawn alone, hidden, for
    the reason filter."""
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
    cells: dict[str, dict[_dt.datetime, int]] = {}
    for bucket, reason, count in timeline.rows:
        b = _parse(bucket)
        totals[b] = totals.get(b, 0) + count
        cells.setdefault(reason, {})[b] = cells.get(reason, {}).get(b, 0) + count
    ticks = _ticks(max(totals.values()))
    ymax = ticks[-1]
    slot_w = plot_w / slots
    bar_w = max(slot_w * 0.85, 0.5)
    scale = plot_h / ymax
    y = lambda v: top + plot_h - scale * v  # noqa: E731
    # data-y0 and data-scale: the script stacks the bars again from them
    out = [f'<svg id="chart-timeline" class="chart" xmlns="http://www.w3.org/2000/svg" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{_e(title)}" data-y0="{top + plot_h}" data-scale="{scale:.6f}">',
           f'<title>{_e(title)}</title>']
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
    base: dict[_dt.datetime, int] = {}

    def series(attrs: str, label: str, color: str, counts: dict) -> None:
        out.append(f'<g {attrs} fill="{color}">')
        for b, count in sorted(counts.items()):
            below = base.get(b, 0)
            base[b] = below + count
            s = int((b - first) / step)
            x0 = left + s * slot_w + (slot_w - bar_w) / 2
            y_top, y_bottom = y(below + count), y(below)
            out.append(
                f'<rect class="bar" x="{x0:.2f}" y="{y_top:.2f}" width="{bar_w:.2f}" '
                f'height="{max(y_bottom - y_top, 0.0):.2f}" data-count="{count}" '
                f'data-slot="{s}"><title>{_e(_when(b.isoformat().replace("+00:00", "Z")))} '
                f'{_e(label)}: {_num(count)}</title></rect>')
        out.append('</g>')

    # stacked bars: reasons in the given order, bottom up; then "other"
    grouped = [r for r in tail if r in cells]
    for reason in reasons:
        if reason in cells and reason not in tail:
            series(f'class="series" data-reason="{_e(reason)}"{_f(reason=reason)}',
                   str(reason), colors[reason], cells[reason])
    if grouped:
        other: dict[_dt.datetime, int] = {}
        for reason in grouped:
            for b, count in cells[reason].items():
                other[b] = other.get(b, 0) + count
        series(f'class="series other" data-reason="(other)"{_f(reason=grouped)}',
               f"other ({len(grouped)} reasons)", OTHER_COLOR, other)
        for reason in grouped:  # each alone, shown by the script when it is the one chosen
            saved = dict(base)
            base.clear()
            series(f'class="series tail off" data-reason="{_e(reason)}"{_f(reason=reason)}',
                   str(reason), OTHER_COLOR, cells[reason])
            base.clear()
            base.update(saved)
    out.append(f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" '
               f'y2="{top + plot_h}"/>')
    out.append('</svg>')
    legend = ['<ul class="legend">']
    for reason in reasons:
        if reason in cells and reason not in tail:
            legend.append(f'<li{_f(reason=reason)}><span class="swatch" '
                          f'style="background:{colors[reason]}"></span>{_e(reason)}</li>')
    if grouped:
        legend.append(f'<li class="other"{_f(reason=grouped)}><span class="swatch" '
                      f'style="background:{OTHER_COLOR}"></span>other: '
                      f'{_e(", ".join(map(str, grouped)))}</li>')
    legend.append('</ul>')
    return "".join(out) + "".join(legend)


def hbar_chart(chart_id: str, title: str, items: list[tuple], color: str = "#4e79a7") -> str:
    """Horizontal bars, one per (label, value[, data-f dimensions]), largest first as given."""
    width, row_h, label_w, right = 1100, 24, 330, 90
    height = max(row_h * len(items) + 16, 40)
    plot_w = width - label_w - right
    out = [f'<svg id="{_e(chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{_e(title)}"><title>{_e(title)}</title>']
    if not items:
        out.append('<text x="10" y="25">none</text></svg>')
        return "".join(out)
    vmax = max(item[1] for item in items) or 1
    for i, (label, count, *dims) in enumerate(items):
        yy = 8 + i * row_h
        w = max(plot_w * count / vmax, 1.0)
        out.append(f'<g class="row"{_f(**dims[0]) if dims else ""}>')
        out.append(f'<text class="blabel" x="{label_w - 8}" y="{yy + 15}" text-anchor="end">'
                   f'{_e(label, 48)}</text>')
        out.append(f'<rect class="bar" x="{label_w}" y="{yy + 3}" width="{w:.2f}" '
                   f'height="{row_h - 6}" fill="{color}" data-count="{count}">'
                   f'<title>{_e(label)}: {_num(count)}</title></rect>')
        out.append(f'<text class="bvalue" x="{label_w + w + 6:.2f}" y="{yy + 15}">'
                   f'{_num(count)}</text></g>')
    out.append('</svg>')
    return "".join(out)


# ------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------

def _table(table_id: str, headers: list[str], rows: list[list[str]],
           numeric: set[int] = frozenset(), attrs: list[str] | None = None) -> str:
    """``rows`` are already-escaped cell contents; ``attrs`` each row's attributes (already
    escaped: ``_f(...)``, ids)."""
    head = "".join(f'<th{" class=num" if i in numeric else ""}>{_e(h)}</th>'
                   for i, h in enumerate(headers))
    body = "".join(
        f"<tr{attrs[n] if attrs else ''}>" + "".join(
            f'<td{" class=num" if i in numeric else ""}>{c}</td>' for i, c in enumerate(row))
        + "</tr>"
        for n, row in enumerate(rows))
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
.off{display:none}
form#filters{position:sticky;top:0;z-index:1;background:#fff;border-bottom:1px solid #ddd;
padding:8px 0;display:flex;flex-wrap:wrap;gap:8px 16px;align-items:center}
form#filters select{max-width:260px}#filter-count{font-weight:600}
pre.rule{margin:4px 0;background:#f7f7f7;padding:6px 8px;border-radius:4px;
font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap}
div.rule{border-left:3px solid #ddd;padding:2px 0 2px 10px;margin:10px 0}
div.rule h3{font-size:14px;margin:0}
:target{outline:2px solid #cc6677;outline-offset:2px}
"""

#: The page's one script: the filters (see the module docstring). It reads the data only from
#: ``data-f`` attributes (JSON.parse) and writes text only with ``textContent``.
SCRIPT = """(function () {
  "use strict";
  var form = document.getElementById("filters");
  if (!form) { return; }
  var names = ["host", "queue", "reason"];
  var items = Array.prototype.slice.call(document.querySelectorAll("[data-f]"));
  var facts = items.map(function (el) { return JSON.parse(el.getAttribute("data-f")); });
  function chosen() {
    var w = {};
    names.forEach(function (k) {
      var v = form.elements[k].value;
      if (v) { w[k] = JSON.parse(v); }
    });
    return w;
  }
  function matches(f, w) {
    for (var k in w) {
      if (!(k in f)) { continue; }
      var v = f[k];
      if (Array.isArray(v) ? v.indexOf(w[k]) < 0 : v !== w[k]) { return false; }
    }
    return true;
  }
  function restack(chart) {
    var y0 = +chart.getAttribute("data-y0"), scale = +chart.getAttribute("data-scale");
    var below = {};
    chart.querySelectorAll("g.series").forEach(function (g) {
      if (g.classList.contains("off")) { return; }
      g.querySelectorAll("rect.bar").forEach(function (r) {
        var slot = r.getAttribute("data-slot"), n = +r.getAttribute("data-count");
        var b = below[slot] || 0;
        r.setAttribute("y", (y0 - scale * (b + n)).toFixed(2));
        r.setAttribute("height", (scale * n).toFixed(2));
        below[slot] = b + n;
      });
    });
  }
  function apply() {
    var w = chosen(), any = Object.keys(w).length > 0, total = 0, shown = 0;
    items.forEach(function (el, i) {
      var on;
      if (el.classList.contains("tail")) { on = "reason" in w && w.reason === facts[i].reason; }
      else if (el.classList.contains("other")) { on = !("reason" in w); }
      else { on = matches(facts[i], w); }
      el.classList.toggle("off", !on);
    });
    document.querySelectorAll("svg[data-y0]").forEach(restack);
    document.querySelectorAll("#table-breakdown tbody tr[data-count]").forEach(function (tr) {
      var n = +tr.getAttribute("data-count");
      total += n;
      if (!tr.classList.contains("off")) { shown += n; }
    });
    var partial = form.getAttribute("data-partial");
    document.getElementById("filter-count").textContent = (any ?
      shown.toLocaleString("en") + " of " + total.toLocaleString("en") +
      (partial ? " dead letters in the breakdown's " + partial + " rows match (the CSV " +
       "by_reason_queue_host has every row)" : " dead letters in the breakdown match") : "") +
      unmatched.map(function (u) {
        return " " + u + " is not among the choices" + (partial ? " (those of the " +
          "breakdown's largest rows)" : "") + ": not applied.";
      }).join("");
    var parts = names.filter(function (k) { return k in w; }).map(function (k) {
      return k + "=" + encodeURIComponent(w[k]);
    });
    try {
      history.replaceState(null, "", parts.length ? "#" + parts.join("&") :
                           location.pathname + location.search);
    } catch (e) { /* a file: URL may refuse; the filters work the same */ }
  }
  // An address's value is matched as the report names things: case, a trailing dot and
  // a port do not matter (VM:7460 is vm; queue_full is QUEUE_FULL).
  function same(v) {
    return String(v).toLowerCase().replace(/:[0-9]+$/, "").replace(/\\.$/, "");
  }
  var unmatched = [];
  location.hash.replace(/^#/, "").split("&").forEach(function (part) {
    var at = part.indexOf("="), select, value, found = false;
    if (at < 0 || names.indexOf(part.slice(0, at)) < 0) { return; }
    try { value = decodeURIComponent(part.slice(at + 1)); } catch (e) { return; }
    select = form.elements[part.slice(0, at)];
    for (var j = 0; j < select.options.length && !found; j++) {
      if (select.options[j].value && same(JSON.parse(select.options[j].value)) === same(value)) {
        select.selectedIndex = j;
        found = true;
      }
    }
    if (!found) { unmatched.push(part.slice(0, at) + " " + value); }
  });
  form.addEventListener("change", function () { unmatched = []; apply(); });
  form.addEventListener("submit", function (e) { e.preventDefault(); });
  document.getElementById("filter-clear").addEventListener("click", function () {
    names.forEach(function (k) { form.elements[k].selectedIndex = 0; });
    unmatched = [];
    apply();
  });
  form.hidden = false;
  document.documentElement.setAttribute("data-filters", "on");
  apply();
}());
"""

#: What the Content-Security-Policy allows the script by.
SCRIPT_HASH = "sha256-" + base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
#: The page's policy: its own inline style and the one script above; nothing else, nothing
#: fetched, no form sent anywhere.
CSP = (f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
       f"script-src '{SCRIPT_HASH}'; base-uri 'none'; form-action 'none'")


def _select(name: str, label: str, values: list, text=str) -> str:
    options = "".join(f'<option value="{_value(v)}">{_e(text(v), 60)}</option>'
                      for v in values)
    return (f'<label>{_e(label)} <select name="{name}" id="filter-{name}">'
            f'<option value="">all</option>{options}</select></label>')


def _rate(v) -> str:
    return "-" if v is None else f"{v:,.2f}/h"


def _trends_section(trends: dict, reason_ids: dict) -> str:
    prev = trends["previous"]
    out = ['<h2 id="trends">Since the previous run</h2>']
    d = trends["dead_letters"]
    out.append(
        f'<p class="note" id="trends-previous">Compared with the run generated '
        f'{_e(_when(prev.get("generated_at")))} ({_e(prev.get("output"), 200)}): '
        f'{_num(d["count"])} dead letters over {_num(float(trends["window_hours"]))} h now '
        f'({_rate(d["rate_per_hour"])}), {_num(d["previous_count"])} over '
        f'{_num(float(prev["window_hours"]))} h then ({_rate(d["previous_rate_per_hour"])}). '
        f'Rate: {_e(trends["rate_definition"])}; a queue "jumped" at {trends["jump_factor"]:g} '
        f'times its previous rate and at least {trends["min_change"]} more dead letters.'
        + (' The previous run left only its top lists (no tables): queues and hosts beyond '
           'them count as new.' if prev.get("partial") else '') + '</p>')
    out.append('<h3>New reasons</h3>')
    out.append(_table(
        "table-new-reasons", ["reason", "dead letters", "meaning"],
        [[f'<a href="#reason-{reason_ids[r["reason"]]}">{_e(r["reason"])}</a>'
          if r["reason"] in reason_ids else _e(r["reason"]), _num(r["count"]),
          _e(_reason_description(r["reason"]))] for r in trends["new_reasons"]],
        numeric={1}, attrs=[_f(reason=r["reason"]) for r in trends["new_reasons"]]))
    jumped = trends["queues_jumped"]
    out.append('<h3>Queues whose dead-letter rate jumped</h3>')
    if jumped:  # (with none, the table alone says so: not a chart that says "none" too)
        out.append(hbar_chart("chart-queues-jumped",
                              "Dead letters per hour now, queues that jumped",
                              [(_queue_label(q), q["rate_per_hour"], {"queue": _queue_id(q)})
                               for q in jumped], color="#cc6677"))
    out.append(_table(
        "table-queues-jumped", ["queue", "dead letters (before)", "rate now", "rate before",
                                "factor"],
        [[_e(_queue_label(q)), f'{_num(q["count"])} ({_num(q["previous_count"])})',
          _rate(q["rate_per_hour"]), _rate(q["previous_rate_per_hour"]),
          "new" if q["factor"] is None else f'{q["factor"]:g}x'] for q in jumped],
        numeric={1, 2, 3, 4}, attrs=[_f(queue=_queue_id(q)) for q in jumped]))
    growing = trends["growing_hosts"]
    out.append('<h3>Growing hosts</h3>')
    if growing:
        out.append(hbar_chart("chart-hosts-growing", "Growth of dead letters per hour, by host",
                              [(f'{h["host"]} ({h["role"]})', h["growth_per_hour"],
                                {"host": [h["host"]]}) for h in growing], color="#882255"))
    out.append(_table(
        "table-hosts-growing", ["host", "as", "dead letters (before)", "rate now",
                                "rate before"],
        [[_e(h["host"]), _e(h["role"]), f'{_num(h["count"])} ({_num(h["previous_count"])})',
          _rate(h["rate_per_hour"]), _rate(h["previous_rate_per_hour"])] for h in growing],
        numeric={2, 3, 4}, attrs=[_f(host=[h["host"]]) for h in growing]))
    return "".join(out)


def _hosts_of(row: dict) -> list:
    return sorted({row.get(k) for k in ("host", "source", "destination")} - {None}, key=str)


def render(summary: dict, timeline: Timeline, samples: list[dict],
           breakdown: list[dict] = (), breakdown_total: int | None = None) -> str:
    """The whole page. ``breakdown``: rows of (reason, queue_key, queue_key_hex, queue_name,
    host, source, destination, count), the largest first (at most :data:`BREAKDOWN_ROWS`
    are shown) of ``breakdown_total`` rows; ``summary["trends"]``, when there, is shown as
    "Since the previous run"."""
    totals = summary["totals"]
    by_reason = summary["by_reason"]
    reasons = [r["reason"] for r in by_reason]
    reasons += sorted({r for _, r, _ in timeline.rows} - set(reasons), key=str)
    colors, tail = _color_map(reasons)
    reason_ids = {r: i for i, r in enumerate(reasons)}
    breakdown = list(breakdown)
    shown_breakdown = breakdown[:BREAKDOWN_ROWS]
    inputs = summary.get("inputs", [])
    archive = inputs[0] if len(inputs) == 1 else None
    parts: list[str] = []
    add = parts.append
    add('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">')
    add(f'<meta http-equiv="Content-Security-Policy" content="{_e(CSP)}">')
    add('<meta name="viewport" content="width=device-width, initial-scale=1">')
    add(f'<title>RQP dead-letter report: {_num(totals["dead_letters"])} dead letters</title>')
    add(f'<style>{_CSS}</style></head><body>')
    add('<h1>RQP dead-letter report</h1>')
    add(f'<p class="meta">Generated {_e(_when(summary.get("generated_at")))} from '
        f'{_e(", ".join(inputs), 300)}. Dead letters from '
        f'{_e(_when(summary.get("first_seen")))} to {_e(_when(summary.get("last_seen")))} '
        f'(UTC).</p>')
    if totals.get("implausible_times"):  # (a summary of an older report has none)
        add(f'<p class="note" id="implausible-times">{_num(totals["implausible_times"])} dead '
            'letter(s) dated before 2000 or more than a day after this report (a host\'s '
            'clock?) are counted, but left out of first and last seen, the timeline and the '
            'trends.</p>')
    left_out = {**(summary.get("left_out") or {}),
                **((summary.get("store") or {}).get("left_out") or {})}
    if left_out:  # (a trial: named on stderr and in summary.json only, not on the page)
        shown = sorted(left_out.items())[:LEFT_OUT_SHOWN]
        more = len(left_out) - len(shown)
        add(f'<p class="note" id="left-out">{_num(len(left_out))} archive file(s) left out of '
            'this report, their dead letters not counted (taken by a later run once they '
            'can be read):</p><ul class="note" id="left-out-files">'
            + "".join(f"<li>{_e(_middle(name, 300))}: {_e(why, 300)}</li>"
                      for name, why in shown)
            + (f"<li>and {_num(more)} more (summary.json names them all)</li>" if more else "")
            + "</ul>")
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

    # The filters: hidden until the script runs (nothing to click with scripts off).
    hosts = sorted({h for row in breakdown for h in _hosts_of(row)}, key=str)
    queues = {}
    for row in breakdown:
        queues.setdefault(_queue_id(row), _queue_label(row))
    all_rows = len(breakdown) if breakdown_total is None else breakdown_total
    partial = (f' data-partial="{_num(len(shown_breakdown))} largest of {_num(all_rows)}"'
               if all_rows > len(shown_breakdown) else "")
    add(f'<form id="filters" hidden{partial}>')
    add(_select("host", "host", hosts))
    add(_select("queue", "queue", sorted(queues, key=str), text=lambda q: queues[q]))
    add(_select("reason", "reason", reasons))
    add('<button type="button" id="filter-clear">show all</button>'
        '<span id="filter-count" role="status"></span>')
    add('<span class="note">A host is where a dead letter was dead-lettered, came from or '
        'was going. Tables and charts without a host (or queue, or reason) are not narrowed '
        'by it; the breakdown is.</span></form>')
    add('<noscript><p class="note">Scripts are off: every row and bar is shown (the filters '
        'need the one script of this page).</p></noscript>')

    if summary.get("trends"):
        add(_trends_section(summary["trends"], reason_ids))

    add('<h2>Dead letters over time</h2>')
    add(timeline_chart(timeline, reasons, colors, tail))

    add('<h2>By reason</h2><p class="note">Each reason links to its sample and to a ready '
        'rule for <code>rqpctl dlq replay</code>.</p>')
    add(_table("table-reasons", ["reason", "dead letters", "share", "first seen", "last seen",
                                 "meaning", "see"],
               [[f'<span class="swatch" style="background:{colors.get(r["reason"], OTHER_COLOR)}">'
                 f'</span>{_e(r["reason"])}', _num(r["count"]),
                 f'{100 * r.get("share", 0):.1f}%', _e(_when(r["first_seen"])),
                 _e(_when(r["last_seen"])), _e(_reason_description(r["reason"])),
                 f'<a class="to-sample" href="#sample-{reason_ids[r["reason"]]}">sample</a> '
                 f'<a class="to-rule" href="#rule-{reason_ids[r["reason"]]}">replay rule</a>']
                for r in by_reason], numeric={1, 2},
               attrs=[f' id="reason-{reason_ids[r["reason"]]}"{_f(reason=r["reason"])}'
                      for r in by_reason]))

    add('<h2 id="rules">Replay rules</h2><p class="note">A rules file for each reason: save '
        'it, run it with <code>--dry-run</code> first, then without. Transient reasons are '
        'retried (once the cause is fixed), reasons that are a property of the message are '
        'discarded (sending it again fails again); narrow a rule with <code>queue:</code>, '
        '<code>host:</code> or <code>older_than:</code> (README, Replay rules). Added to '
        '<code>/etc/rqp/dlq-rules.yaml</code>, a rule is applied to each new dead letter as '
        'it arrives by <code>rqp-dlq-handler.service</code>.</p>')
    for r in by_reason:
        i, rule = reason_ids[r["reason"]], _rules.replay_rule(r["reason"])
        action = _rules.suggested_action(r["reason"])
        add(f'<div class="rule" id="rule-{i}"{_f(reason=r["reason"])}>'
            f'<h3>{_e(r["reason"])}: <span class="action">{_e(action or "no rule")}</span> '
            f'<a href="#sample-{i}">sample</a></h3>')
        if rule is None:
            add('<p class="note">The replay tool does not know this reason: no rule.</p>')
        else:
            add(f'<pre class="rule">{_e(rule)}</pre><pre class="rule">'
                f'{_e(_rules.replay_command(archive, f"rules-{i}.yaml"))}</pre>')
        add('</div>')

    add(f'<h2>Top destination queues</h2><p class="note">{_num(totals["queues"])} queue keys '
        f'in all; the {min(len(summary["top_queues"]), totals["queues"])} with the most dead '
        f'letters.</p>')
    add(hbar_chart("chart-queues", "Dead letters per destination queue",
                   [(_queue_label(q), q["count"], {"queue": _queue_id(q)})
                    for q in summary["top_queues"]]))
    add(_table("table-queues", ["queue key", "name", "dead letters", "first seen", "last seen"],
               [[_e(q.get("queue_key_hex")), _e(q.get("queue_name") or "-"), _num(q["count"]),
                 _e(_when(q["first_seen"])), _e(_when(q["last_seen"]))]
                for q in summary["top_queues"]], numeric={2},
               attrs=[_f(queue=_queue_id(q)) for q in summary["top_queues"]]))

    add('<h2>Top hosts</h2>')
    add(f'<p class="note">One name per machine: a loopback address is the host that saw it, '
        f'ports and case are dropped. Source host: where the message was sent from. '
        f'{_num(totals["source_hosts"])} in all.</p>')
    add(hbar_chart("chart-source-hosts", "Dead letters per source host",
                   [(h["source"], h["count"], {"host": [h["source"]]})
                    for h in summary["top_source_hosts"]], color="#117733"))
    add(f'<p class="note">Destination host: where it was going ("(unknown)" when the record '
        f'does not say). {_num(totals["destination_hosts"])} in all.</p>')
    add(hbar_chart("chart-destination-hosts", "Dead letters per destination host",
                   [(h["destination"], h["count"], {"host": [h["destination"]]})
                    for h in summary["top_destination_hosts"]], color="#cc6677"))

    total = len(breakdown) if breakdown_total is None else breakdown_total
    add('<h2>Breakdown</h2><p class="note">Dead letters per reason, queue and host (where '
        'dead-lettered, source, destination): what the filters narrow.'
        + (f' The {_num(len(shown_breakdown))} largest of {_num(total)} rows; all are in '
           f'csv/by_reason_queue_host.' if total > len(shown_breakdown) else '') + '</p>')
    add(_table("table-breakdown", ["reason", "queue", "dead-lettered at", "source",
                                   "destination", "dead letters"],
               [[f'<a href="#reason-{reason_ids[b["reason"]]}">{_e(b["reason"])}</a>'
                 if b.get("reason") in reason_ids else _e(b.get("reason")),
                 _e(_queue_label(b)), _e(b.get("host")), _e(b.get("source")),
                 _e(b.get("destination")), _num(b["count"])] for b in shown_breakdown],
               numeric={5},
               attrs=[f' data-count="{int(b["count"])}"'
                      f'{_f(reason=b.get("reason"), queue=_queue_id(b), host=_hosts_of(b))}'
                      for b in shown_breakdown]))

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
                for p in summary["payload_stats"]], numeric={1, 2, 3, 4, 5, 6},
               attrs=["" if p["reason"] == "(all)" else _f(reason=p["reason"])
                      for p in summary["payload_stats"]]))

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
                for r in rec["by_reason"]], numeric={2},
               attrs=[_f(reason=r["reason"]) for r in rec["by_reason"]]))

    rank = {r: i for i, r in enumerate(reasons)}
    samples = sorted(samples, key=lambda s: (rank.get(s.get("reason"), len(rank)),
                                             str(s.get("reason"))))
    add('<h2>Samples</h2><p class="note">The earliest dead letter of each reason.</p>')
    add(_table("table-samples", ["reason", "id / time", "queue", "route", "detail",
                                 "payload preview"],
               [[f'{_e(s.get("reason"))}<br><a href="#rule-{reason_ids[s.get("reason")]}">'
                 f'replay rule</a>' if s.get("reason") in reason_ids else _e(s.get("reason")),
                 f'<code class="sample-id">{_e(s.get("id"))}</code><br>'
                 f'{_e(_when(s.get("timestamp")))}',
                 _e(_queue_label(s)),
                 f'{_e(s.get("source"))} &rarr; {_e(s.get("destination"))}<br>'
                 f'{_e(s.get("agent"))} on {_e(s.get("host"))}, {_e(s.get("message_type"))}, '
                 f'{_num(s.get("original_length"))} B',
                 _e(s.get("detail"), 200),
                 f'<pre class="preview">{_e(s.get("payload_preview"), 200)}</pre>'
                 if s.get("payload_preview") else '<span class="note">(no payload)</span>']
                for s in samples],
               attrs=[(f' id="sample-{reason_ids[s.get("reason")]}"'
                       if s.get("reason") in reason_ids else "")
                      + _f(reason=s.get("reason"), queue=_queue_id(s), host=_hosts_of(s))
                      for s in samples]))
    add('<p class="note">Every table is also under parquet/ and csv/ beside this page; '
        'summary.json has the totals.</p>')
    add(f'<script>{SCRIPT}</script>')
    add('</body></html>\n')
    return "".join(parts)
