"""The exception hierarchy: every error the project raises is an :class:`RQPError`.

Errors say whose fault it was (h11 / h2 style), and what they mean for a message: an error
that stops a message from being put carries its dead-letter :attr:`reason` (from the one table,
:mod:`rqp.protocol.reasons`), so the receiving MCA dead-letters with ``exc.reason`` and answers
what the table says; a :class:`ProtocolError` always closes the connection (spec 5.3: a byte
stream cannot be resynchronised).
"""

from __future__ import annotations

from rqp.protocol.reasons import ReasonCode


class RQPError(Exception):
    """Base class of every error raised by the ``rqp`` package, its tools and the agents."""

    #: The dead-letter reason of a message this error stopped (None: not about one message).
    reason: ReasonCode | None = None


class ProtocolError(RQPError):
    """A frame or a sequence of frames broke the rules of the protocol: the connection that
    carried it is closed."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class ConfigError(RQPError):
    """A configuration file or value is wrong. The message names the file, key and value."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        super().__init__(message)
        self.path = path
        self.key = key


class QueueError(RQPError):
    """A local System V queue could not be opened, created, read or written."""

    reason = ReasonCode.PUT_FAILED

    def __init__(self, message: str, *, queue_key: int | None = None):
        super().__init__(message)
        self.queue_key = queue_key


class QueueNotFound(QueueError):
    """No System V queue exists with the given key."""

    reason = ReasonCode.UNKNOWN_QUEUE


class QueuePermissionDenied(QueueError):
    """The queue exists but this process may not use it that way."""

    reason = ReasonCode.NOT_AUTHORIZED


class QueueFull(QueueError):
    """The queue has no room for the message right now (it may have later)."""

    reason = ReasonCode.QUEUE_FULL


class MessageTooBig(RQPError):
    """A message does not fit in one System V message (kernel ``msgmax``) or a configured limit."""

    reason = ReasonCode.MESSAGE_TOO_BIG

    def __init__(self, message: str, *, size: int, limit: int):
        super().__init__(message)
        self.size = size
        self.limit = limit


class RecordError(RQPError):
    """A transmission-queue or dead-letter record could not be decoded."""

    reason = ReasonCode.MALFORMED_RECORD
