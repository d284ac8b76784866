"""The dead-letter report's parts that need no Spark (issue 16): the replay rule of each reason
(loaded by the replay tool itself), the page's colours and filters' markup, the trends between
two runs, and the dated runs under ``--reports`` (latest link, pruning, locks).

The report end to end with ``--reports`` and the page's filters in a real browser are in
tests/test_report.py (they need the Spark session and the browser).
"""

from __future__ import annotations

import datetime as dt
import html.parser
import json
import os
import re

import pytest

from rqp.protocol import reasons
from rqp.report import history, rules, trends
from rqp.report.common import ReportError
from rqp.report import html as report_html
from rqp.tools import replay

# --------------------------------------------------------------------------------------------
# A ready replay rule per reason
# --------------------------------------------------------------------------------------------

ROW = {"reason": None, "queue_key": 0x52510001, "message_type": "SURE", "host": "vm",
       "source_host": "vm", "destination_host": "", "timestamp_ns": 0}


@pytest.mark.parametrize("reason", [r.name for r in reasons.REASONS] + ["UNKNOWN_77"])
def test_each_reasons_rule_loads_in_the_replay_tool_and_acts_on_that_reason(reason, tmp_path):
    text = rules.replay_rule(reason)
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    loaded = replay.load_rules(path)  # the tool's own validation
    known = reasons.BY_NAME.get(reason)
    expected = "discard" if known is not None and known.intrinsic else "retry"
    assert rules.suggested_action(reason) == expected
    assert replay.decide(loaded, dict(ROW, reason=reason), 0).action == expected
    other = "NO_ROUTE" if reason != "NO_ROUTE" else "QUEUE_FULL"
    assert replay.decide(loaded, dict(ROW, reason=other), 0).action == "keep"
    assert text.startswith("# ") and "\nrules:\n" in text  # says why, then the rule
    if expected == "retry":  # never for ever (the handler applies it to each dead letter)
        (rule,) = loaded
        assert (rule.retries, rule.interval, rule.then) == (rules.RETRIES, 600.0, "keep")


def test_transient_reasons_retry_and_intrinsic_ones_never_do():
    assert {rules.suggested_action(r) for r in reasons.TRANSIENT} == {"retry"}
    assert {rules.suggested_action(r) for r in reasons.INTRINSIC} == {"discard"}
    # a reason the replay tool would refuse gets no rule rather than one that does not load
    for odd in ("NOT_A_REASON", "QUEUE_*", None, "", "UNKNOWN_"):
        assert rules.replay_rule(odd) is None and rules.suggested_action(odd) is None


# --------------------------------------------------------------------------------------------
# The page: colours, links, filters' markup, escaping
# --------------------------------------------------------------------------------------------

def summary_of(by_reason: list[tuple[str, int]], hosts=("hosta",), **extra) -> dict:
    """The least summary render needs."""
    total = sum(n for _, n in by_reason)
    when = "2025-03-03T09:00:00.000000Z"
    return {
        "generated_at": when, "inputs": ["/var/lib/rqp/dlq-archive"],
        "first_seen": when, "last_seen": when,
        "totals": {"dead_letters": total, "lines": total, "duplicates_dropped": 0,
                   "unreadable_lines": 0, "files": 1, "queues": 1,
                   "source_hosts": len(hosts), "destination_hosts": 1,
                   "likely_recoverable": 0, "reasons": len(by_reason)},
        "by_reason": [{"reason": r, "count": n, "share": n / total, "first_seen": when,
                       "last_seen": when} for r, n in by_reason],
        "top_queues": [{"queue_key": 1, "queue_key_hex": "0x00000001", "queue_name": "Q",
                        "count": total, "first_seen": when, "last_seen": when}],
        "top_source_hosts": [{"source": h, "count": 1} for h in hosts],
        "top_destination_hosts": [{"destination": "hostb", "count": total}],
        "by_message_type": [], "payload_stats": [],
        "likely_recoverable": {"evidence": "transient_reason", "by_reason": []},
        **extra,
    }


class Page(html.parser.HTMLParser):
    """What these tests look for: tags, ids, the timeline's series and data-f attributes."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)

    def all(self, tag: str, cls: str | None = None) -> list[dict]:
        return [a for t, a in self.tags if t == tag
                and (cls is None or cls in (a.get("class") or "").split())]

    def ids(self) -> set[str]:
        return {a["id"] for _, a in self.tags if "id" in a}


THIRTEEN = [(r.name, 100 - i) for i, r in enumerate(reasons.REASONS[:13])]


def timeline_of(by_reason):
    return report_html.Timeline(1, tuple(("2025-03-03T09:00:00.000000Z", r, n)
                                         for r, n in by_reason))


def test_thirteen_reasons_get_distinct_colours_and_the_tail_is_other():
    """Issue 16: the 13 stacked colours were hard to tell apart."""
    page = Page(report_html.render(summary_of(THIRTEEN), timeline_of(THIRTEEN), []))
    series = page.all("g", "series")
    coloured = [s for s in series if not {"other", "tail"} & set(s["class"].split())]
    assert [s["data-reason"] for s in coloured] == [r for r, _ in THIRTEEN[:8]]
    fills = [s["fill"] for s in coloured]
    assert fills == list(report_html.PALETTE[:8]) and len(set(fills)) == 8
    other = page.all("g", "other")
    assert len(other) == 1 and other[0]["fill"] == report_html.OTHER_COLOR
    assert json.loads(other[0]["data-f"]) == {"reason": [r for r, _ in THIRTEEN[8:]]}
    tail = page.all("g", "tail")  # each grouped reason alone, hidden until chosen
    assert [t["data-reason"] for t in tail] == [r for r, _ in THIRTEEN[8:]]
    assert all("off" in t["class"].split() for t in tail)
    # nine or fewer: every one its own colour, no "other"
    nine = THIRTEEN[:9]
    page = Page(report_html.render(summary_of(nine), timeline_of(nine), []))
    assert [s["fill"] for s in page.all("g", "series")] == list(report_html.PALETTE)


def test_each_reason_links_to_its_sample_and_its_replay_rule():
    by_reason = [("QUEUE_FULL", 3), ("MESSAGE_TOO_BIG", 2), ("NOT_A_REASON", 1)]
    samples = [{"reason": r, "id": f"id-{r}", "queue_key_hex": "0x00000001", "host": "vm",
                "source": "vm", "destination": "hostb"} for r, _ in by_reason]
    text = report_html.render(summary_of(by_reason), timeline_of(by_reason), samples)
    page = Page(text)
    ids = page.ids()
    for i, (reason, _) in enumerate(by_reason):
        assert {f"reason-{i}", f"sample-{i}", f"rule-{i}"} <= ids
        links = {a["href"] for a in page.all("a")}
        assert {f"#sample-{i}", f"#rule-{i}"} <= links
    rule = re.search(r'<div class="rule" id="rule-1".*?</div>', text, re.S).group()
    assert "action: discard" in rule and "rqpctl dlq replay --archive /var/lib/rqp/dlq-archive" \
        " --rules rules-1.yaml --dry-run" in rule
    assert "action: retry" in re.search(r'id="rule-0".*?</div>', text, re.S).group()
    assert "no rule" in re.search(r'id="rule-2".*?</div>', text, re.S).group()


def test_one_script_allowed_by_its_hash_and_hostile_names_stay_text():
    evil = 'h"><script>alert(1)</script>\u202e'
    by_reason = [("QUEUE_FULL", 2)]
    breakdown = [{"reason": "QUEUE_FULL", "queue_key": 1, "queue_key_hex": "0x00000001",
                  "queue_name": "<b>Q</b>", "host": evil, "source": evil,
                  "destination": "hostb", "count": 2}]
    text = report_html.render(summary_of(by_reason, hosts=(evil,)), timeline_of(by_reason),
                              [], breakdown)
    page = Page(text)
    assert len(page.all("script")) == 1 and page.scripts == [report_html.SCRIPT]
    assert "alert(1)</script>" not in text and "<b>Q</b>" not in text
    assert "\u202e" not in text and "\\u202e" in text
    csp = next(a["content"] for a in page.all("meta") if a.get("http-equiv") ==
               "Content-Security-Policy")
    assert f"script-src '{report_html.SCRIPT_HASH}'" in csp
    assert "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    assert "default-src 'none'" in csp and "form-action 'none'" in csp
    # a name with any characters is one option, whose value parses to what data-f holds
    option = next(a for a in page.all("option") if a["value"] and "script" in a["value"])
    row = next(a for a in page.all("tr") if "data-count" in a)  # the breakdown's
    assert json.loads(option["value"]) == evil
    assert json.loads(row["data-f"])["host"] == [evil, "hostb"]
    # the filters are hidden until the script shows them
    assert "hidden" in page.all("form")[0]


# --------------------------------------------------------------------------------------------
# Trends
# --------------------------------------------------------------------------------------------

def facts(first, last, reasons_, queues, sources, destinations=None, total=None):
    return trends.RunFacts(
        generated_at=last, first_seen=first, last_seen=last,
        dead_letters=total if total is not None else sum(reasons_.values()),
        reasons=reasons_, queues=queues, source_hosts=sources,
        destination_hosts=destinations or {}, output="/reports/prev")


def test_trends_new_reasons_jumped_queues_growing_hosts():
    before = facts("2025-03-01T00:00:00Z", "2025-03-02T00:00:00Z",  # 24 h
                   {"QUEUE_FULL": 48, "NO_ROUTE": 24},
                   {"0x1": ("A.Q", 48), "0x2": ("B.Q", 24)}, {"vm": 60, "web": 12})
    now = facts("2025-03-01T00:00:00Z", "2025-03-03T00:00:00Z",     # 48 h
                {"QUEUE_FULL": 200, "NO_ROUTE": 48, "MESSAGE_TOO_BIG": 3},
                {"0x1": ("A.Q", 200), "0x2": ("B.Q", 48), "0x3": (None, 3)},
                {"vm": 80, "web": 171})
    t = trends.compare(now, before)
    assert t["new_reasons"] == [{"reason": "MESSAGE_TOO_BIG", "count": 3}]
    # A.Q: 2/h before, 200/48 = 4.17/h now (x2.08, +152): jumped. B.Q: 1/h both. 0x3: new but
    # only 3 (under MIN_CHANGE): not a jump.
    assert [(q["queue_key_hex"], q["rate_per_hour"], q["previous_rate_per_hour"], q["factor"])
            for q in t["queues_jumped"]] == [("0x1", 4.167, 2.0, 2.08)]
    # web: 0.5/h -> 3.56/h; vm: 2.5/h -> 1.67/h (more dead letters, a lower rate): not growing
    assert [(h["host"], h["role"], h["growth_per_hour"]) for h in t["growing_hosts"]] == [
        ("web", "source", 3.062)]
    assert t["window_hours"] == 48 and t["previous"]["window_hours"] == 24
    assert "per hour" in t["rate_definition"]
    assert t["dead_letters"] == {"count": 251, "previous_count": 72, "rate_per_hour": 5.229,
                                 "previous_rate_per_hour": 3.0}


def test_trends_windows_of_less_than_an_hour_count_as_one():
    burst = facts("2025-03-01T00:00:00Z", "2025-03-01T00:00:02Z", {"QUEUE_FULL": 30},
                  {"0x1": (None, 30)}, {"vm": 30})
    empty = facts(None, None, {}, {}, {})
    t = trends.compare(burst, empty)
    assert t["queues_jumped"][0]["rate_per_hour"] == 30.0  # not 54,000/h
    assert t["queues_jumped"][0]["factor"] is None           # new: no previous rate
    assert t["new_reasons"] == [{"reason": "QUEUE_FULL", "count": 30}]


def test_trends_render_in_the_page():
    before = facts("2025-03-01T00:00:00Z", "2025-03-02T00:00:00Z", {"QUEUE_FULL": 4},
                   {"0x00000001": ("Q", 4)}, {"hosta": 4})
    now = facts("2025-03-01T00:00:00Z", "2025-03-02T00:00:00Z", {"QUEUE_FULL": 40,
                                                                 "NO_ROUTE": 2},
                {"0x00000001": ("Q", 42)}, {"hosta": 42})
    by_reason = [("QUEUE_FULL", 40), ("NO_ROUTE", 2)]
    summary = summary_of(by_reason, trends=trends.compare(now, before))
    page = Page(report_html.render(summary, timeline_of(by_reason), []))
    assert {"trends", "chart-queues-jumped", "chart-hosts-growing", "table-new-reasons"} <= \
        page.ids()
    assert [json.loads(g["data-f"]) for g in page.all("g", "row")][:2] == [
        {"queue": "0x00000001"}, {"host": ["hosta"]}]


# --------------------------------------------------------------------------------------------
# Dated runs: --reports DIR --keep N
# --------------------------------------------------------------------------------------------

T0 = dt.datetime(2026, 11, 23, 6, 0, tzinfo=dt.timezone.utc)


def complete(run: history.Run, total: int = 1) -> None:
    """What the job leaves in a run (summary.json last of what a reader needs)."""
    with open(os.path.join(run.path, "summary.json"), "w") as f:
        json.dump({"totals": {"dead_letters": total}}, f)


def day(n: int) -> dt.datetime:
    return T0 + dt.timedelta(days=n)


def test_runs_are_dated_compared_with_the_previous_and_latest_follows(tmp_path):
    reports = str(tmp_path / "reports")
    first = history.start(reports, day(0))
    assert first.name == "20261123T060000Z" and first.previous is None
    complete(first)
    assert first.finish(keep=3) == []
    assert os.readlink(tmp_path / "reports/latest") == first.name
    second = history.start(reports, day(1))
    assert second.previous == first.path
    complete(second)
    second.finish(keep=3)
    assert os.readlink(tmp_path / "reports/latest") == "20261124T060000Z"
    # two in the same second: each its own directory
    a, b = history.start(reports, day(2)), history.start(reports, day(2))
    assert (a.name, b.name) == ("20261125T060000Z", "20261125T060000Z-2")
    a.close()
    b.close()


def test_keep_n_deletes_older_runs_and_failed_ones_not_those_under_way_or_read(tmp_path):
    reports = str(tmp_path / "reports")
    names = []
    for n in range(4):
        run = history.start(reports, day(n))
        complete(run)
        run.finish(keep=10)
        names.append(run.name)
    failed = history.start(reports, day(4))       # died: no summary, lock released
    failed.close()
    reader = history.start(reports, day(5))       # compares with day 3, reading it now
    assert reader.previous.endswith(names[3])
    under_way = history.start(reports, day(6))    # another job, not finished
    # a job comparing with day 0 holds its lock (as start does for its previous)
    import fcntl
    held = os.open(os.path.join(reports, names[0], history.LOCK), os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        run = history.start(reports, day(7))
        complete(run)
        deleted = run.finish(keep=2)
    finally:
        os.close(held)
    # kept: day 7 and day 3 (the newest two complete); day 0 is being read; day 1, 2 go,
    # and the failed day 4; day 5 (its reader's own run) and 6 are under way
    assert sorted(deleted) == sorted([names[1], names[2], failed.name])
    assert history.run_names(reports) == [names[0], names[3], reader.name, under_way.name,
                                          run.name]
    assert os.readlink(os.path.join(reports, "latest")) == run.name
    # the older job that finishes later does not take latest from the newer run
    complete(under_way)
    under_way.finish(keep=2)
    assert os.readlink(os.path.join(reports, "latest")) == run.name
    reader.close()


def test_a_reader_waits_for_a_writer_to_let_go_and_skips_a_run_deleted_meanwhile(tmp_path):
    reports = str(tmp_path / "reports")
    old = history.start(reports, day(0))
    complete(old)
    old.finish()
    gone = history.start(reports, day(1))
    complete(gone)
    gone.finish()
    # day 1 deleted by someone else: the next run compares with day 0
    import shutil
    shutil.rmtree(os.path.join(reports, gone.name))
    run = history.start(reports, day(2))
    assert run.previous == old.path
    run.close()


def test_latest_must_be_a_symlink_and_keep_at_least_one(tmp_path):
    reports = tmp_path / "reports"
    (reports / "latest").mkdir(parents=True)
    run = history.start(str(reports), day(0))
    complete(run)
    with pytest.raises(ReportError, match="not a symlink"):
        run.finish()
    run = history.start(str(reports), day(1))
    complete(run)
    with pytest.raises(ValueError):
        run.finish(keep=0)
    run.close()
