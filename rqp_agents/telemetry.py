"""What the agents show operators: the ``rqpctl status`` document and the Prometheus metrics
of each agent, read from the agent's state (nothing here changes it). One home for every
metric name and status field, so that docs, dashboards and alerts have one place to look."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import asdict

from rqp import BUILD, __version__
from rqp.protocol.constants import QUEUE_MEMORY
from rqp.protocol.errors import QueueNotFound, RQPError
from rqp.protocol.sender import ROUTE_CACHE, ROUTE_STATES
from rqp.storage.deadletters import RECEIVER_SHARE
from rqp.system.control import Metric
from rqp.system.queues import LocalQueue, format_key, list_queues

__all__ = ["sender_status", "sender_metrics", "receiver_status", "receiver_metrics"]


class QueueFigures:
    """What a receiving MCA did per queue key (messages put, repeats, dead-lettered, bytes
    put) for the QUEUE_MEMORY keys most recently busy; the others' are added up in
    ``forgotten``: a peer sending to ever new queue keys grows neither the agent nor a scrape
    without end (a trial: 26,000 queues, 2.2 s a scrape of the receiving MCA alone)."""

    OUTCOMES = ("put", "repeat", "dead_lettered")  # (then the bytes put)

    def __init__(self, memory: int = QUEUE_MEMORY) -> None:
        self.memory = memory
        self.by_queue: OrderedDict[int, list[int]] = OrderedDict()  # the least recent first
        self.forgotten = [0, 0, 0, 0]
        self.forgotten_queues = 0

    def count(self, queue_key: int, outcome: int, size: int = 0) -> None:
        """One message of ``queue_key``: ``outcome`` an index of OUTCOMES, ``size`` bytes put."""
        figures = self.by_queue.get(queue_key)
        if figures is None:
            figures = self.by_queue[queue_key] = [0, 0, 0, 0]
            if len(self.by_queue) > self.memory:
                _, gone = self.by_queue.popitem(last=False)
                self.forgotten = [a + b for a, b in zip(self.forgotten, gone)]
                self.forgotten_queues += 1
        else:
            self.by_queue.move_to_end(queue_key)
        figures[outcome] += 1
        figures[3] += size


def offered_queues(agent, among=None) -> list[dict]:
    """The local queues of a receiving MCA's host (but DEAD.LETTER.Q), and whether each is
    offered; with ``among`` (keys), only those and the queues its config names."""
    out = []
    for q in list_queues():
        if q.key == agent.config.dead_letter_queue or among is not None and \
                q.key not in among and not agent.config.queue_name(q.key):
            continue
        offered = agent.delivery.offers(q.key)
        out.append({"queue": format_key(q.key), "queue_key": q.key,
                    "name": agent.config.queue_name(q.key), "depth": q.messages,
                    "bytes": q.bytes, "mode": f"{q.mode:03o}", "offered": offered,
                    "why_not": None if offered else agent.delivery.why_not_offered(q.key, q)[0]})
    return out


def _depth(queue: LocalQueue) -> int | None:
    """Messages on ``queue``, the one now under its key if it was removed (and maybe made
    again since); None if there is none, or it cannot be read."""
    try:
        return queue.depth
    except QueueNotFound:
        try:
            return LocalQueue.open(queue.key).depth
        except RQPError:
            return None
    except RQPError:
        return None


def sender_status(agent) -> dict:
    return {**_sender_figures(agent), "routes": sender_routes(agent)}


def sender_routes(agent, only: int | None = None) -> list[dict]:
    """Status's routes (every one, or ``only`` that queue's), times as Unix times."""
    routes = agent.core.route_status(agent.loop.time(), only)
    to_wall = time.time() - agent.loop.time()  # the core's times are the loop's clock
    for route in routes:
        route["queue"] = format_key(route["queue_key"])
        route["name"] = agent.config.queue_name(route["queue_key"])
        for row in (route, *route.get("copies", ())):
            for field in ("since", "last_error_at", "last_message_at", "last_confirmed_at",
                          "oldest_taken_at", "stalled_since"):
                if row.get(field) is not None:
                    row[field] += to_wall
    return routes


def _sender_figures(agent) -> dict:
    to_wall = time.time() - agent.loop.time()
    return {
        "agent": "sender", "pid": os.getpid(), "host": agent.host,
        "version": __version__, "build": BUILD, "started_at": agent.started,
        "uptime": time.time() - agent.started,
        "source": agent.config.source, "last_reload": agent.last_reload,
        "transmission_queue": format_key(agent.config.transmission_queue),
        "transmission_queue_depth": _depth(agent.intake.queue),
        "transmission_queue_trouble": agent.intake.journal_full or agent.intake.trouble,
        "start_reserve": str(agent.reserve.path), "start_reserve_missing": agent.reserve.missing,
        "dead_letter_queue": format_key(agent.config.dead_letter_queue),
        "dead_letter_queue_depth": _depth(agent.dead_letters.queue),
        "dead_letters_held": agent.dead_letters_held,
        "dead_letters_held_why": agent.dead_letters_held_why,
        "journal_depth": agent.intake.journal.live_count, "held": agent.core.held,
        "waiting_for_route": agent.core.waiting_for_route(),
        "in_flight": agent.core.in_flight, "window": agent.config.window,
        "held_most": agent.intake.budget.size, "incarnation": f"{agent.keys.incarnation:08x}",
        "hosts": [_host_status(agent, h, to_wall) for h in
                  (*agent.config.hosts, *agent.core.removed_hosts_connected())],
        "queue_memory": QUEUE_MEMORY, "route_cache": ROUTE_CACHE,
        "forgotten": asdict(agent.core.forgotten),
        "stats": dict(agent.stats),
        "dead_letters": dict(agent.dead_letters.by_reason), "now": time.time(),
    }


def _host_status(agent, host, to_wall: float) -> dict:
    figures = agent.core.host_figures(host)
    if figures["heartbeat_failed_at"] is not None:
        figures["heartbeat_failed_at"] += to_wall  # (the core's times are the loop's clock)
    return {"host": str(host), "connection": agent.core.link_state(host).value,
            "connection_text": agent.core.connection_text(host), **figures}


#: How a message ends, as route_status counts it (a broadcast copy may also be declined).
OUTCOMES = ("delivered", "lost", "unconfirmed_at_close", "dead_lettered")


def sender_metrics(agent) -> list[Metric]:
    """The sending MCA's metrics as they are now (rendered by the caller, off the loop)."""
    now = agent.loop.time()
    routes = agent.core.route_status(now)
    m = {name: Metric(name, kind, text) for name, kind, text in (
        ("rqp_sender_messages_total", "counter", "MESSAGE frames sent, by queue"),
        ("rqp_sender_bytes_total", "counter", "payload bytes sent, by queue"),
        ("rqp_sender_outcomes_total", "counter",
         "messages finished, by queue and outcome (unconfirmed_at_close: UNSURE ones a "
         "receiver's close in order cut off, most likely put; lost: UNSURE ones not confirmed "
         "after a failure)"),
        ("rqp_sender_errors_total", "counter",
         "failed tries (a MESSAGE not confirmed, or no host offered the queue), by queue "
         "(peer: the host of its route now; rqp_sender_host_errors_total: where they failed)"),
        ("rqp_sender_route_changes_total", "counter", "routes found or dropped, by queue"),
        ("rqp_sender_unsure_errors_in_a_row", "gauge",
         "UNSURE errors in a row on the route (error_limit of them drops it)"),
        ("rqp_sender_in_flight", "gauge", "messages sent and not answered, by queue (an atomic batch once)"),
        ("rqp_sender_waiting", "gauge", "messages taken and not sent yet, by queue (an atomic batch once)"),
        ("rqp_sender_lag_seconds", "gauge",
         "age of the oldest message waiting or in flight, by queue (0: none)"),
        ("rqp_sender_stalled_seconds", "gauge",
         "seconds since the route last made progress while stalled, by queue (0: not stalled)"),
        ("rqp_sender_route_state", "gauge", "1 for the state each route is in, else 0"),
        ("rqp_sender_forgotten_total", "counter",
         f"idle queues whose figures were let go beyond the {QUEUE_MEMORY} most recently busy "
         "(what=queues: their series end, their figures go on under queue=\"forgotten\"), "
         f"routes let go beyond the {ROUTE_CACHE} most recently found (what=routes: asked "
         "for again)"),
        ("rqp_sender_copies_total", "counter",
         "broadcast copies finished, by queue, host and outcome"),
        ("rqp_sender_copies_waiting", "gauge", "broadcast copies not sent yet, by queue and host"),
        ("rqp_sender_heartbeats_total", "counter", "heartbeat QUEUE_ASKs sent, by host"),
        ("rqp_sender_heartbeat_failures_total", "counter",
         "heartbeats not answered in time (the connection was closed), by host"),
        ("rqp_sender_host_errors_total", "counter",
         "failed tries of messages sent to a host (not confirmed, or it could not be reached "
         "for an UNSURE one), by host"),
        ("rqp_dead_letters_total", "counter", "dead letters written here, by reason"),
        ("rqp_journal_depth", "gauge", "SURE messages in the journal (an atomic batch once)"),
        ("rqp_sender_journal_full", "gauge",
         "1 while the journal takes no SURE records (state_dir full, or the start reserve "
         "cannot be made): they wait on the transmission queue"),
        ("rqp_sender_start_reserve_missing", "gauge",
         "1 while the reserve kept in state_dir for the next start cannot be made (no room)"),
        ("rqp_sender_transmission_queue_unreadable", "gauge",
         "1 while the transmission queue cannot be read (its permissions, a kernel error): "
         "nothing is taken from it, tried again every second"),
        ("rqp_sender_dead_letters_held", "gauge",
         "dead letters held in memory because DEAD.LETTER.Q is full"),
        ("rqp_sender_waiting_for_route", "gauge",
         "messages held while no host offers their queue (asking, or waiting to ask again)"),
        ("rqp_dead_letter_queue_depth", "gauge", "records on DEAD.LETTER.Q"),
        ("rqp_transmission_queue_depth", "gauge", "records on the transmission queue"))}
    for r in routes:
        q = {"queue": format_key(r["queue_key"]), "name": agent.config.queue_name(
            r["queue_key"]) or "", "peer": r["peer"] or ""}
        m["rqp_sender_messages_total"].add(r["sent"], **q)
        m["rqp_sender_bytes_total"].add(r["sent_bytes"], **q)
        for outcome in OUTCOMES:
            m["rqp_sender_outcomes_total"].add(r[outcome], outcome=outcome, **q)
        m["rqp_sender_errors_total"].add(r["errors"], **q)
        m["rqp_sender_route_changes_total"].add(r["route_changes"], **q)
        m["rqp_sender_unsure_errors_in_a_row"].add(r["error_counter"], **q)
        m["rqp_sender_in_flight"].add(r["in_flight"], **q)
        m["rqp_sender_waiting"].add(r["waiting"], **q)
        m["rqp_sender_lag_seconds"].add(round(r["lag"], 3), **q)
        m["rqp_sender_stalled_seconds"].add(
            0 if r["stalled_since"] is None else round(now - r["stalled_since"], 3), **q)
        for state in ROUTE_STATES:  # every route in every state, not only the healthy ones
            m["rqp_sender_route_state"].add(int(r["state"] == state), state=state, **q)
        for c in r.get("copies", ()):
            h = {**q, "peer": c["peer"]}
            for outcome in ("declined", *OUTCOMES):
                m["rqp_sender_copies_total"].add(c[outcome], outcome=outcome, **h)
            m["rqp_sender_copies_waiting"].add(c["waiting"], **h)
            m["rqp_sender_unsure_errors_in_a_row"].add(c["error_counter"], **h)
    gone = agent.core.forgotten  # (their figures under queue="forgotten": the sums stay whole)
    q = {"queue": "forgotten", "name": "", "peer": ""}
    m["rqp_sender_messages_total"].add(gone.sent, **q)
    m["rqp_sender_bytes_total"].add(gone.sent_bytes, **q)
    for outcome in OUTCOMES:
        m["rqp_sender_outcomes_total"].add(getattr(gone, outcome), outcome=outcome, **q)
    m["rqp_sender_errors_total"].add(gone.errors, **q)
    m["rqp_sender_route_changes_total"].add(gone.route_changes, **q)
    for what in ("queues", "routes"):
        m["rqp_sender_forgotten_total"].add(getattr(gone, what), what=what)
    for host in agent.config.hosts:
        figures = agent.core.host_figures(host)
        m["rqp_sender_heartbeats_total"].add(figures["heartbeats"], peer=str(host))
        m["rqp_sender_heartbeat_failures_total"].add(figures["heartbeat_failures"],
                                                     peer=str(host))
        m["rqp_sender_host_errors_total"].add(figures["failed_tries"], peer=str(host))
    for reason, count in sorted(agent.dead_letters.by_reason.items()):
        m["rqp_dead_letters_total"].add(count, reason=reason)
    m["rqp_journal_depth"].add(agent.intake.journal.live_count)
    m["rqp_sender_journal_full"].add(int(agent.intake.journal_full is not None))
    m["rqp_sender_transmission_queue_unreadable"].add(int(agent.intake.trouble is not None))
    m["rqp_sender_start_reserve_missing"].add(int(agent.reserve.missing is not None))
    m["rqp_sender_dead_letters_held"].add(agent.dead_letters_held)
    m["rqp_sender_waiting_for_route"].add(agent.core.waiting_for_route())
    for name, queue in (("rqp_dead_letter_queue_depth", agent.dead_letters.queue),
                        ("rqp_transmission_queue_depth", agent.intake.queue)):
        depth = _depth(queue)
        if depth is not None:
            m[name].add(depth)
    return [*m.values(), *_agent_metrics(agent)]


def _agent_metrics(agent) -> list[Metric]:
    """What each agent exports of itself: how long it has run, and its last reload."""
    last = agent.last_reload
    return [
        Metric("rqp_build_info", "gauge", "1, labelled with the agent's rqp version").add(
            1, version=__version__, build=BUILD),
        Metric("rqp_up_seconds", "gauge", "seconds since the agent started").add(
            round(time.time() - agent.started, 3)),
        Metric("rqp_config_last_reload_successful", "gauge",
               "0 while the last reload (SIGHUP) stands refused: the agent runs a config that "
               "is no longer its file's; 1 otherwise (none since the start too)").add(
            int(last is None or last["ok"])),
        Metric("rqp_config_last_reload_timestamp_seconds", "gauge",
               "Unix time of the last reload (SIGHUP), taken or refused; 0: none since the "
               "start").add(round(last["at"], 3) if last else 0),
    ]


def _state_dir_trouble(agent) -> list[dict]:
    """The receiving MCA's last failed writes to its state_dir, one per kind (for status)."""
    out = []
    if agent.dedup_trouble is not None:
        error, at = agent.dedup_trouble
        out.append({"what": "dedup", "error": error, "at": at, "count": agent.dedup_failures})
    writer = agent.dead_letters
    if writer.spill_trouble is not None:
        out.append({"what": "spill", "error": writer.spill_trouble, "at": writer.spill_trouble_at,
                    "count": writer.unspilled})
    return out


def receiver_status(agent) -> dict:
    window = agent.dedup.state()  # (first: it drops the keys past their age)
    return {
        "agent": "receiver", "pid": os.getpid(), "host": agent.host,
        "version": __version__, "build": BUILD, "started_at": agent.started,
        "uptime": time.time() - agent.started,
        "source": agent.config.source, "last_reload": agent.last_reload,
        "listen": str(agent.config.listen),
        "state_dir": os.path.abspath(agent.config.state_dir),
        "max_message_size": agent.max_message_size,
        "dead_letter_queue": format_key(agent.config.dead_letter_queue),
        "dead_letter_queue_depth": _depth(agent.dead_letters.queue),
        "dedup_window_keys": window["keys"],  # (kept: the same as dedup_window["keys"])
        "dedup_window": window,
        "connections": sorted(
            ({**info, "may_use": agent.gate.grant(agent._who[task]).describe()}
             for task, info in agent._peers.items()), key=lambda p: p["since"]),
        "queues": offered_queues(agent),
        "tls": agent.config.tls is not None,
        "peers_rules": None if agent.config.peers is None else [  # (None: every peer may
            rule.describe() for rule in agent.config.peers],  # use every offered queue)
        "stats": {**agent.stats, "dead_letters": agent.dead_letters.written,
                  "refused_connections": agent.gate.refused_connections,
                  "handshake_failures": sum(agent.gate.handshake_failures.values()),
                  "denied": sum(agent.gate.denied.values()),
                  "dead_letters_header_only": sum(agent.gate.header_only.values()),
                  "dead_letters_suppressed": sum(agent.gate.suppressed.values()),
                  "dead_letters_no_room": sum(agent.no_room.values())},
        "dead_letters_no_room_at": agent.no_room_at,
        "dead_letters_no_room_why": agent.no_room_why,
        "state_dir_trouble": _state_dir_trouble(agent),
        "dead_letter_room": agent.dead_letters.room_within(RECEIVER_SHARE),
        "dead_letter_queue_unmade": _unmade(agent.dead_letters),
        "open_connections": agent.gate.open,  # (those in "connections", and handshakes)
        "handshake_failures": dict(agent.gate.handshake_failures),
        "denied": dict(agent.gate.denied),
        "dead_letters_limited": {"header_only": dict(agent.gate.header_only),
                                 "suppressed": dict(agent.gate.suppressed),
                                 "no_room": dict(agent.no_room)},
        "dead_letters": dict(agent.dead_letters.by_reason), "now": time.time(),
    }


def receiver_metrics(agent) -> list[Metric]:
    """The receiving MCA's metrics as they are now (rendered by the caller, off the loop)."""
    m = {name: Metric(name, kind, text) for name, kind, text in (
        ("rqp_receiver_messages_total", "counter", "MESSAGE frames, by queue and outcome"),
        ("rqp_receiver_forgotten_total", "counter",
         f"queues whose figures were let go beyond the {QUEUE_MEMORY} most recently busy "
         "(their series end, their figures go on under queue=\"forgotten\")"),
        ("rqp_receiver_bytes_total", "counter", "payload bytes put, by queue"),
        ("rqp_receiver_asks_total", "counter", "QUEUE_ASK frames answered"),
        ("rqp_receiver_connections", "gauge", "connections from sending MCAs"),
        ("rqp_receiver_connections_total", "counter", "connections accepted"),
        ("rqp_receiver_connections_refused_total", "counter",
         "connections closed at once: over max_connections_per_source, or over "
         "max_connections with no connection idle to close for them"),
        ("rqp_receiver_connections_timed_out_total", "counter",
         "connections closed by first_frame_timeout or idle_timeout"),
        ("rqp_receiver_connections_evicted_total", "counter",
         "idle connections closed to let a new one in when max_connections were open"),
        ("rqp_receiver_late_frames_total", "counter",
         "frames that came after this side closed a connection in order (idle_timeout, room "
         "for a new one, a stop): taken, but unanswered"),
        ("rqp_receiver_protocol_errors_total", "counter",
         "connections closed for a protocol error (a frame that breaks the spec)"),
        ("rqp_receiver_tls_handshake_failures_total", "counter",
         "connections closed because the TLS handshake failed, by reason"),
        ("rqp_receiver_denied_total", "counter",
         "QUEUE_ASK and MESSAGE frames refused by the peers rules, by peer"),
        ("rqp_receiver_dead_letters_limited_total", "counter",
         "dead letters not written whole: over the peer's dead_letter_rate (kind header_only, "
         "suppressed), or no room in DEAD.LETTER.Q within the receiver's share (no_room)"),
        ("rqp_accepts_out_of_descriptors_total", "counter",
         "accepts refused by the system for want of file descriptors"),
        ("rqp_dead_letters_total", "counter", "dead letters written here, by reason"),
        ("rqp_dead_letter_queue_depth", "gauge", "records on DEAD.LETTER.Q"),
        ("rqp_receiver_dedup_keys", "gauge",
         "SURE message keys held in the de-duplication window"),
        ("rqp_receiver_dedup_max_keys", "gauge", "dedup_window_keys: the most it holds"),
        ("rqp_receiver_dead_letters_no_room_timestamp_seconds", "gauge",
         "Unix time of the last dead letter not written for want of room in DEAD.LETTER.Q "
         "(within the receiver's share; kept in state_dir across restarts); 0: none"),
        ("rqp_receiver_state_write_failures_total", "counter",
         "writes to state_dir that failed (a full or broken disk), by what: dedup (the "
         "connection is closed, its last SURE messages unanswered: sent again) or spill (a "
         "dead letter's payload cut to one message, its end not kept)"),
        ("rqp_receiver_state_write_failure_timestamp_seconds", "gauge",
         "Unix time of the last of those failures; 0: none since the start"),
        ("rqp_receiver_dedup_oldest_seconds", "gauge",
         "age of the oldest key held (when full, how long a key stays in the window)"),
        ("rqp_receiver_queue_depth", "gauge", "messages waiting in each local queue"),
        ("rqp_receiver_queue_offered", "gauge", "1 if the queue is offered to askers"))}
    figures = agent.figures
    rows = [(format_key(key), f) for key, f in sorted(figures.by_queue.items())]
    for queue, f in rows + ([("forgotten", figures.forgotten)] if figures.forgotten_queues
                            else []):
        for outcome, count in zip(QueueFigures.OUTCOMES, f):
            if count:
                m["rqp_receiver_messages_total"].add(count, queue=queue, outcome=outcome)
        if f[0]:
            m["rqp_receiver_bytes_total"].add(f[3], queue=queue)
    m["rqp_receiver_forgotten_total"].add(figures.forgotten_queues, what="queues")
    m["rqp_receiver_asks_total"].add(agent.stats["asks"])
    m["rqp_receiver_connections"].add(len(agent._peers))
    m["rqp_receiver_connections_total"].add(agent.stats["connections"])
    m["rqp_receiver_connections_refused_total"].add(agent.gate.refused_connections)
    m["rqp_receiver_connections_timed_out_total"].add(agent.stats["timed_out_connections"])
    m["rqp_receiver_connections_evicted_total"].add(agent.stats["evicted_connections"])
    m["rqp_receiver_late_frames_total"].add(agent.stats["late_frames"])
    m["rqp_receiver_protocol_errors_total"].add(agent.stats["protocol_errors"])
    for reason, count in sorted(agent.gate.handshake_failures.items()):
        m["rqp_receiver_tls_handshake_failures_total"].add(count, reason=reason)
    for peer, count in sorted(agent.gate.denied.items()):
        m["rqp_receiver_denied_total"].add(count, peer=peer)
    for kind, counts in (("header_only", agent.gate.header_only),
                         ("suppressed", agent.gate.suppressed), ("no_room", agent.no_room)):
        for peer, count in sorted(counts.items()):
            m["rqp_receiver_dead_letters_limited_total"].add(count, peer=peer, kind=kind)
    m["rqp_receiver_dead_letters_no_room_timestamp_seconds"].add(
        round(agent.no_room_at or 0, 3))
    trouble = _state_dir_trouble(agent)
    for what, count in (("dedup", agent.dedup_failures), ("spill", agent.dead_letters.unspilled)):
        m["rqp_receiver_state_write_failures_total"].add(count, what=what)
    m["rqp_receiver_state_write_failure_timestamp_seconds"].add(
        round(max((t["at"] for t in trouble), default=0), 3))
    m["rqp_accepts_out_of_descriptors_total"].add(agent.out_of_descriptors.count)
    for reason, count in sorted(agent.dead_letters.by_reason.items()):
        m["rqp_dead_letters_total"].add(count, reason=reason)
    depth = _depth(agent.dead_letters.queue)
    if depth is not None:
        m["rqp_dead_letter_queue_depth"].add(depth)
    window = agent.dedup.state()
    m["rqp_receiver_dedup_keys"].add(window["keys"])
    m["rqp_receiver_dedup_max_keys"].add(window["max_keys"])
    if window["oldest_age"] is not None:
        m["rqp_receiver_dedup_oldest_seconds"].add(round(window["oldest_age"], 3))
    for q in offered_queues(agent, among=figures.by_queue):
        m["rqp_receiver_queue_depth"].add(q["depth"], queue=q["queue"])
        m["rqp_receiver_queue_offered"].add(int(q["offered"]), queue=q["queue"])
    return [*m.values(), *_agent_metrics(agent)]


def _unmade(dead_letters) -> str | None:
    """Why DEAD.LETTER.Q cannot be made, if it still cannot (looked at again: another agent
    may have made it meanwhile)."""
    dead_letters.look_again()
    return dead_letters.unmade
