"""The sending MCA's side of its transmission queue: journal first, then take.

A reader thread copies records off the transmission queue (peek, not take), journals the SURE
ones with one fsync per batch, and only then takes the batch off the queue and hands it to the
event loop: a kill -9 at any moment loses no SURE record, and what was journaled but not yet
taken is recognised at the next start (:meth:`Intake.recover`). How many messages may be held
in memory is bounded (:class:`Budget`); the rest wait in the kernel queue, where, unlike in
memory, UNSURE ones survive a crash of the sender.

With the queue empty, the reader thread waits in ``msgrcv`` itself (:meth:`LocalQueue.wait`,
which takes nothing): the producer's ``msgsnd`` wakes it, so a producer does nothing but put its
record (no doorbell to ring: a semaphore operation cost ``sendMessage`` half of its CPU, and a
C program that did not ring waited up to 50 ms).

A record longer than the kernel's msgmax (put before an operator lowered it) cannot be copied:
the kernel copies at most msgmax bytes. It is taken first and journaled right after (a crash in
between loses that one record, said in a warning), for a queue that stopped at it would stop
every record behind it, for good.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from rqp.protocol.constants import SURE_MSG
from rqp.protocol.errors import QueueError, QueueFull, QueueNotFound, RecordError, RQPError
from rqp.protocol.keys import queue_key_problem
from rqp.protocol.records import TransmissionRecord
from rqp.protocol.sender import budget_size
from rqp.storage.journal import FULL as NO_ROOM, Journal, JournalError, no_space
from rqp.system.files import SpaceReserve
from rqp.system.queues import LocalQueue, format_key
from rqp.system.service import KeySource
from rqp_agents.daemon import RateLimitedLog, SpellLog

__all__ = ["START_RESERVE", "Budget", "Intake", "Item", "NoReserve", "Taken", "budget_size",
           "messages_in", "start_reserve_size"]

log = logging.getLogger("rqp.sender")

#: Records taken in one go by the reader thread once the first one has arrived.
READ_BATCH = 256
#: How often the reader tries again while the journal's disk is full (seconds).
NO_ROOM_WAIT = 1.0
#: Least seconds between two lines saying that the journal cannot take SURE records, and
#: how long a spell of it lasts before it is said all the same.
NO_ROOM_SAY_AGAIN = 60.0
NO_ROOM_LASTING = 10.0
#: Bytes kept free in state_dir for the sending MCA's next start (:class:`SpaceReserve`):
#: its own small files, beside the copy of a record's journal entry that a kill tore
#: (:func:`start_reserve_size`; a trial with msgmax 65536 had no room for that copy).
START_RESERVE = 64 << 10


def start_reserve_size(msgmax: int) -> int:
    """START_RESERVE and one record's room (msgmax and a page), in whole pages."""
    return START_RESERVE + -(-(msgmax + 4096) // 4096) * 4096

#: A record read off the queue: ``[bytes, TransmissionRecord or RecordError, key, journal seq,
#: copies]``; ``copies``: for a broadcast queue key, ``((key, host), ...)``, else None.
Item = list


def messages_in(record) -> int:
    """How many application messages a record read off the queue is: a batch's members, 1
    for any other (and for one that could not be read, a RecordError)."""
    return len(record.members()) if getattr(record, "is_batch", False) else 1


class Taken:
    """What the core's ``origin`` of a message holds: its record and its journal seq."""

    __slots__ = ("record", "seq")

    def __init__(self, record: TransmissionRecord, seq: int | None) -> None:
        self.record = record
        self.seq = seq


class Budget:
    """How many more messages may be held in memory (the rest wait in the kernel queue)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = size
        self._cond = threading.Condition()

    def take(self, want: int, timeout: float) -> int:
        with self._cond:
            if self._free <= 0:
                self._cond.wait(timeout)
            got = max(0, min(self._free, want))
            self._free -= got
            return got

    def force(self, n: int) -> None:  # replayed messages are held whatever the budget
        with self._cond:
            self._free -= n

    def give(self, n: int) -> None:
        with self._cond:
            self._free += n
            self._cond.notify()

    def resize(self, size: int) -> None:
        """A new size (SIGHUP: another window or host list); what is held stays held."""
        with self._cond:
            self._free += size - self.size
            self.size = size
            self._cond.notify()


class NoReserve(JournalError):
    """SURE records are not journaled while the start reserve is missing (see Intake)."""


class Intake:
    """The transmission queue, the journal of SURE records and the reader thread.

    The journal never takes the room of the sending MCA's start reserve (``reserve``, freed
    by the start before its own writes): while the reserve cannot be made again, SURE records
    wait on the transmission queue as when the journal's disk is full, and
    :meth:`keep_reserve` is called every second. So a sending MCA stopped or killed on a full
    disk can always start again.
    """

    def __init__(self, transmission_queue: int, state_dir: Path, name: str, keys: KeySource,
                 budget: int, reserve: SpaceReserve) -> None:
        self.key = transmission_queue
        self.queue = LocalQueue.create(transmission_queue)
        self.keys = keys
        self.budget = Budget(budget)
        self.journal = Journal(state_dir, name)
        for problem in self.journal.problems:  # (each names the journal's file)
            log.error("journal %s", problem)
        for note in self.journal.notes:
            log.info("journal %s", note)
        self.reserve = reserve
        self._stop_reading = threading.Event()
        self._reader: threading.Thread | None = None
        self._long_records = RateLimitedLog(log, 10.0, 20, what="records longer than msgmax")
        #: Why the reader cannot read the transmission queue now (None: it can), for the
        #: status: records wait there meanwhile.
        self.trouble: str | None = None
        #: Why the journal takes no SURE records now (its disk is full; None: it does): they
        #: wait on the transmission queue meanwhile.
        self.journal_full: str | None = None
        #: The "cannot take" line comes at most once a NO_ROOM_SAY_AGAIN (a trial's full disk,
        #: freed by each delivery, logged 21 pairs of lines in 22 s), but always for a spell
        #: that lasts NO_ROOM_LASTING (another's log ended with "takes again" while full).
        self._full_log = SpellLog(log, NO_ROOM_SAY_AGAIN, NO_ROOM_LASTING)
        #: Records read in one go: READ_BATCH, halved while a batch finds no room (trial 10:
        #: 256 records of 8 KB never fit a 2 MiB state_dir, and the reader waited for ever
        #: with the disk 99 % free; trial 11: 192 waited with half of it free, the journal
        #: holding messages in flight).
        self._batch_cap = READ_BATCH
        #: Records journaled before this start that may still be on the queue, past one too
        #: long to copy (see recover), within the next ``_journaled_window`` records read.
        self._journaled_still: set[bytes] = set()
        self._journaled_window = 0
        #: (broadcast queue keys, hosts): what a broadcast record is copied to (spec section 6).
        self.fanout: tuple[frozenset, tuple] = (frozenset(), ())

    # --- the start reserve ---------------------------------------------------------------------

    def keep_reserve(self, *, at_start: bool = False) -> bool:
        """Make the start reserve if it is missing (``at_start``: the start freed it); with no
        room for it, cut the journal back first if nothing in it is live (released entries
        take the disk until the next append otherwise). Returns whether it is there; logs
        when that changes."""
        was = self.reserve.missing
        gone = not at_start and was is None and not self.reserve.there()  # (removed by hand)
        made = self.reserve.make()
        if not made and self.journal.live_count == 0:
            try:
                if self.journal.cut_back_if_empty():
                    made = self.reserve.make()
            except (OSError, JournalError) as exc:
                log.warning("journal %s: cannot cut it back to make room: %s",
                            self.journal.path, exc)
        if made and was is not None:
            log.warning("the start reserve %s is made again: SURE records are journaled "
                        "again", self.reserve.path)
        elif made and gone:
            log.warning("the start reserve %s was gone (removed by hand?): made again",
                        self.reserve.path)
        elif not made and was is None:
            log.error("the start reserve %s (%d KiB) cannot be made: %s: SURE records wait "
                      "on the transmission queue until it is (tried every second), so that "
                      "this sending MCA could start again if it stopped now; make room in %s",
                      self.reserve.path, self.reserve.size >> 10, self.reserve.missing,
                      self.reserve.path.parent,
                      extra={"event": "reserve_missing"})
        return made

    # --- start: what the journal holds ---------------------------------------------------------

    def recover(self) -> tuple[list[Item], list[Item]]:
        """Journaled SURE messages, to be sent first, in order, with their keys; then the
        records of a batch that a kill left on the queue beside journaled ones (taken off)."""
        entries = self.journal.recovered
        if not entries:
            return [], []
        # A kill between journaling a batch and taking all of it off the queue leaves some of
        # its records in both. They are within the first READ_BATCH records of the queue, maybe
        # mixed with UNSURE ones of the same batch (never journaled, never handed on): take
        # the batch off; the journaled ones are sent from the journal, the others as new.
        journaled = {entry.record for entry in entries}
        head, too_long = self.queue.copy_head(READ_BATCH)
        last = max((i for i, data in enumerate(head) if data in journaled), default=-1)
        leftovers = [data for data in head[:last + 1] if data not in journaled]
        if last >= 0:
            self._take_off(head[:last + 1])
        found = last + 1 - len(leftovers)  # journaled, and still on the queue: taken off
        if too_long is not None:
            # msgmax was lowered before this start: a record of that batch may now be too
            # long to copy, and the batch go on past it. The reader, reading as ever (each
            # record journaled before it is taken, but a long one), takes those journaled
            # already off without handing them on: they are sent from the journal.
            self._journaled_still = journaled.difference(head)
            self._journaled_window = READ_BATCH
        self.budget.force(len(entries) + len(leftovers))
        first = [[entry.record, TransmissionRecord.from_bytes(entry.record), entry.key,
                  entry.seq, entry.copies] for entry in entries]
        records = f" in {len(entries)} record(s)" if any(item[1].is_batch for item in first) \
            else ""
        log.info("journal: %d SURE message(s)%s to send again first%s",
                 sum(messages_in(item[1]) for item in first), records,
                 f" ({found} of them also still on the transmission queue, taken off)"
                 if found else "")
        return first, (self._journal(leftovers) if leftovers else [])

    # --- the reader thread ---------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list[Item]], None],
              stop: Callable[[], None], fatal: Callable[[str, BaseException], None]) -> None:
        """Read in a thread; each batch goes to ``deliver`` on ``loop``; if SURE records
        cannot be journaled (or, journaled, taken off the queue), ``stop`` is called there;
        an unexpected error goes to ``fatal``."""
        signal.signal(signal.SIGUSR1, lambda *_: None)  # wakes the reader thread, nothing else

        def read() -> None:
            try:
                self._read_records(loop, deliver, stop)
            except Exception as exc:  # noqa: BLE001 - unexpected: the agent stops
                fatal("the transmission-queue reader thread", exc)

        self._reader = threading.Thread(target=read, name="xmit-reader", daemon=True)
        self._reader.start()

    async def stop(self) -> None:
        self._stop_reading.set()
        while self._reader is not None and self._reader.is_alive():
            signal.pthread_kill(self._reader.ident, signal.SIGUSR1)  # EINTR for its waits
            await asyncio.sleep(0.05)

    def _read_records(self, loop, deliver, stop) -> None:
        stopping = self._stop_reading.is_set
        while not stopping():
            room = self.budget.take(self._batch_cap, timeout=0.2)
            if not room:
                continue
            try:
                batch, taken = self._copy_batch(room)
            except QueueError as exc:
                self.budget.give(room)
                self._queue_trouble(exc)
                continue
            if self.trouble is not None:  # (a trial: it resumed without a word)
                log.info("the transmission queue can be read again")
                self.trouble = None
            if len(batch) < room:
                self.budget.give(room - len(batch))
            if not batch:
                self._wait(loop, deliver)
                continue
            before = (self._journaled_window, set(self._journaled_still)) \
                if self._journaled_window else None  # (after a start only)
            new = self._not_journaled(batch)
            if self.journal_full is not None and not self.reserve.there():
                self.keep_reserve()  # (room freed on a full disk goes to the reserve first:
                # trial 13's journal took a reserve removed by hand within 2 ms)
            try:
                items = self._journal(new)
            except RQPError as exc:
                self.budget.give(len(batch))
                if no_space(exc) and not taken:  # (copied again next time: as before it)
                    if before is not None:
                        self._journaled_window, self._journaled_still = before
                    if len(batch) > 1 and not isinstance(exc, NoReserve):
                        self._batch_cap = max(1, len(batch) // 2)  # (at once: it may fit)
                        continue
                    self._no_room(exc)
                    continue
                log.critical("cannot journal SURE records: %s -- stopping, records stay on "
                             "the transmission queue%s", exc, " (but the one taken before it "
                             "was journaled is lost)" if taken else "")
                loop.call_soon_threadsafe(stop)
                return
            if self.journal_full is not None:
                self.journal_full = None
                self._full_log.over("the journal takes SURE records again")
            if self._batch_cap < READ_BATCH:
                self._batch_cap = min(READ_BATCH, 2 * self._batch_cap)
            if len(new) < len(batch):  # (sent from the journal: their places go back)
                self.budget.give(len(batch) - len(new))
            if taken:
                loop.call_soon_threadsafe(deliver, items)
                continue
            try:
                self._take_off(batch)  # now, and only now, off the queue
            except QueueNotFound as exc:  # removed meanwhile, with what was left of the batch:
                loop.call_soon_threadsafe(deliver, items)  # they are here, and nowhere else
                self._queue_trouble(exc)
                continue
            except QueueError as exc:  # still there: taken at the next start, not twice now
                self.budget.give(len(new))
                log.critical("cannot take journaled records off the transmission queue: %s "
                             "-- stopping; the next start sends the journaled ones first and "
                             "takes them off", exc)
                loop.call_soon_threadsafe(stop)
                return
            loop.call_soon_threadsafe(deliver, items)

    def _no_room(self, exc: RQPError) -> None:
        """The journal's disk is full: the records stay on the transmission queue, and the
        reader tries again every NO_ROOM_WAIT seconds (the messages in flight, confirmed,
        leave the journal, which is then cut back; or an operator makes room). A trial's
        sending MCA on a 2 MiB state_dir stopped instead, after 253 messages, every time."""
        where = f"the start reserve {self.reserve.path} cannot be made" \
            if isinstance(exc, NoReserve) else self.journal.path
        why = f"{NO_ROOM}: {exc.__cause__.strerror} ({where}); the records wait here, tried " \
            "again every second"
        self._full_log.still(why, extra={"event": "journal_full"})
        self.journal_full = why
        self._stop_reading.wait(NO_ROOM_WAIT)

    def _wait(self, loop, deliver) -> None:
        """Wait for the next record (or a signal: the stop). The only one the wait takes is
        an empty one: it is no record, and is handed on as such (dead-lettered)."""
        try:
            taken = self.queue.wait()
        except QueueError as exc:
            self._queue_trouble(exc)
            return
        if taken is not None:  # (taken off already: handed on like any unreadable record)
            self.budget.force(1)
            loop.call_soon_threadsafe(deliver, self._journal([taken[0]]))

    def _not_journaled(self, batch: list[bytes]) -> list[bytes]:
        """``batch`` but the records journaled before this start (see recover): those are
        taken off with the others, and sent from the journal."""
        if not self._journaled_window:
            return batch
        new = []
        for data in batch:
            if self._journaled_window and data in self._journaled_still:
                self._journaled_still.discard(data)
                log.info("a record journaled before the start was still on the transmission "
                         "queue, past one too long to copy: taken off, sent from the journal")
            else:
                new.append(data)
            self._journaled_window = max(0, self._journaled_window - 1)
        if not self._journaled_still:
            self._journaled_window = 0
        return new

    def _copy_batch(self, limit: int) -> tuple[list[bytes], bool]:
        """Copies of the next records, and False; or the next one taken off (longer than
        the kernel's msgmax, it cannot be copied), and True."""
        batch, too_long = self.queue.copy_or_take_head(limit)
        if too_long is not None:
            self._long_records.report(
                "%s -- taken off before it is journaled (a crash now would lose it), so that "
                "the records behind it move", logging.WARNING, too_long)
        return batch, too_long is not None

    def _journal(self, batch: list[bytes]) -> list[Item]:
        """Parse, give keys, journal the SURE records (one fsync): [data, record, key, seq,
        copies]. A broadcast record gets a key per copy (one copy per host), journaled with it,
        so that each copy keeps its key across restarts."""
        items, sure = [], []
        broadcast, hosts = self.fanout
        for data in batch:
            try:
                record = TransmissionRecord.from_bytes(data)
            except RecordError as exc:
                items.append([data, exc, 0, None, None])
                continue
            n = len(record.members()) if record.is_batch else 1  # a batch: a key per message
            key = self.keys.block(n)
            if record.replays_key and record.sequence and n == 1:
                key = record.sequence  # a replayed dead letter keeps its original key
            copies = None
            if record.queue_key in broadcast:
                copies = tuple((key if i == 0 else self.keys.block(n), str(host))
                               for i, host in enumerate(hosts))
            if record.message_type == SURE_MSG and not queue_key_problem(record.queue_key):
                sure.append(len(items))
            items.append([data, record, key, None, copies])
        if sure and self.reserve.missing is not None:
            raise NoReserve(f"the start reserve {self.reserve.path} cannot be made") from \
                OSError(errno.ENOSPC, self.reserve.missing)
        seqs = self.journal.append([(items[i][2], items[i][0], items[i][4]) for i in sure])
        for i, seq in zip(sure, seqs):
            items[i][3] = seq
        return items

    def _take_off(self, batch: list[bytes]) -> None:
        # nobody else takes from it, so these are the records copied
        if self.queue.take_head(len(batch)) != batch:
            log.error("the transmission queue %s has another reader: records taken off it "
                      "were not the ones copied", format_key(self.key))

    def _queue_trouble(self, exc: QueueError) -> None:
        if isinstance(exc, QueueNotFound):
            log.error("transmission queue %s was removed: opening its key again (a queue "
                      "made since, or a new one)", format_key(self.key))
            self.queue = LocalQueue.create(self.key)
        else:
            if self.trouble != str(exc):  # (said again only when it changes; the status
                log.error("cannot read the transmission queue: %s -- trying again every "
                          "second", exc)  # says it meanwhile)
            self.trouble = str(exc)
            self._stop_reading.wait(1.0)

    # --- journal releases and the way back -----------------------------------------------------

    def release(self, seqs: list[int]) -> None:
        """Journal RELEASE entries (no fsync of their own: a lost release only means a re-send
        after a crash, which the receiver recognises by its key)."""
        self.journal.release(seqs)
        if self.journal.maybe_compact():
            log.info("journal compacted: %d live message(s), %d bytes",
                     self.journal.live_count, self.journal.file_bytes)

    async def put_back(self, messages: list, deadline: float, grace: float) -> None:
        """Messages not sent yet go back on the transmission queue (at its end), without
        blocking the loop (a second SIGTERM must still work) and until ``deadline`` (loop
        time) at the latest."""
        loop = asyncio.get_running_loop()
        done = done_messages = 0  # records, and the messages in them (a batch's)
        for msg in messages:
            while True:
                try:
                    self.queue.put(msg.origin.record.to_bytes(), block=False)
                    done += 1
                    done_messages += msg.count
                    break
                except QueueFull:
                    if loop.time() >= deadline:
                        break
                    await asyncio.sleep(0.05)
                except RQPError as exc:
                    log.error("cannot put message key=%#018x back on the transmission queue: "
                              "%s", msg.key, exc)
                    break
        log.info("%d record(s) not sent yet put back on the transmission queue (%d message(s))",
                 done, done_messages)
        if done < len(messages):
            log.error("%d message(s) could not be put back (transmission queue %s full for "
                      "%gs) and are lost", len(messages) - done, format_key(self.key), grace)
