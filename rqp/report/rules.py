"""What to do with a reason's dead letters: a ready rule for ``rqpctl dlq replay``.

The report shows, for each reason, a rules file (the syntax of :mod:`rqp.tools.replay`) that
the reader can save and run with ``--dry-run`` first. The action follows the reason table
(:mod:`rqp.protocol.reasons`, the one home of what a reason means):

* an intrinsic reason (a property of the message: ``MESSAGE_TOO_BIG``, ``EXPIRED``,
  ``MALFORMED`` ...) is never retried: the same message fails again however well the
  destination works, so the rule is ``discard`` (once the samples have been read);
* every other reason is ``retry``: a transient one (``QUEUE_FULL``, ``UNKNOWN_QUEUE`` ...) once
  the destination is back to normal, the others (``NOT_AUTHORIZED``,
  ``RETRY_BUDGET_EXHAUSTED`` ...) once what the comment names is fixed. ``retry`` sends it with
  its original message key, so a receiver that had in fact put it recognises the repeat.

A reason the replay tool would refuse as a pattern (not in the table and not ``UNKNOWN_<n>``,
e.g. a newer writer's name, or none) gets no rule: a rule that does not load helps nobody.
This module needs neither Spark nor the replay tool (the report may not import
:mod:`rqp.tools`); ``tests/test_report.py`` loads every rule with the replay tool's own
validation and checks its decision on a matching row.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap

from rqp.protocol import reasons as _reasons

__all__ = ["suggested_action", "replay_rule", "replay_command"]

_UNKNOWN = re.compile(r"UNKNOWN_[0-9]+")
#: A suggested retry's limits (as in config/dlq-rules.example.yaml): applied by the handler to
#: each new dead letter, a retry without them would go on every minute for ever.
RETRIES = 5
INTERVAL = "10m"


def suggested_action(reason: str | None) -> str | None:
    """``retry``, ``discard``, or None when the replay tool would not take the reason."""
    if not isinstance(reason, str):
        return None
    known = _reasons.BY_NAME.get(reason)
    if known is None:
        return "retry" if _UNKNOWN.fullmatch(reason) else None
    return "discard" if known.intrinsic else "retry"


def _why(reason: str) -> str:
    known = _reasons.BY_NAME.get(reason)
    if known is None:
        return (f"{reason}: a reason code this version does not know; retry once its cause "
                f"is understood.")
    if known.intrinsic:
        return (f"{reason} is a property of the message ({known.description}): sending it "
                f"again fails again. Discard once the samples are read.")
    if known.transient:
        return (f"{reason} is transient ({known.description}): retry once the destination "
                f"is back to normal.")
    return f"{reason}: {known.description}. Retry once that is fixed."


def replay_rule(reason: str | None) -> str | None:
    """A rules file (YAML) for ``rqpctl dlq replay`` that acts on this reason's dead letters
    (see the module docstring), or None."""
    action = suggested_action(reason)
    if action is None:
        return None
    comment = "\n".join(f"# {line}" for line in textwrap.wrap(_why(reason), 88))
    # A JSON string is a YAML double-quoted scalar; the names have no wildcard characters.
    rule = f"{comment}\nrules:\n  - reason: {json.dumps(reason)}\n    action: {action}\n"
    if action == "retry":  # never for ever: the handler would retry it every minute
        rule += (f"    retries: {RETRIES}   # at most {RETRIES} times ...\n"
                 f"    interval: {INTERVAL}   # ... {INTERVAL} apart; then it is kept\n")
    return rule


def replay_command(archive: str | None, rules_file: str) -> str:
    """The command that runs a rule file, dry first."""
    where = shlex.quote(archive) if archive else "ARCHIVE_DIR"
    return f"rqpctl dlq replay --archive {where} --rules {shlex.quote(rules_file)} --dry-run"

