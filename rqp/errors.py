"""The exception hierarchy: every error the project raises is an :class:`RQPError`.

Errors say whose fault it was (h11 / h2 style). A :class:`ProtocolError` carries its consequence
on the wire as class attributes, so the agents never need to guess what to do with one.
"""

from __future__ import annotations

import enum


class WireAction(enum.Enum):
    """What a connection does when an error is raised while handling a frame."""

    CLOSE_CONNECTION = "close the connection"
    DELIVERED_ERROR = "answer DELIVERED_ERROR"
    QUEUE_NO = "answer QUEUE_NO"


class RQPError(Exception):
    """Base class of every error raised by the ``rqp`` package and the agents."""


class ProtocolError(RQPError):
    """A frame or a sequence of frames broke the rules of the protocol."""

    #: Spec 5.3: a stream cannot be resynchronised, so the default is to close the connection.
    wire_action: WireAction = WireAction.CLOSE_CONNECTION


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

    def __init__(self, message: str, *, queue_key: int | None = None):
        super().__init__(message)
        self.queue_key = queue_key


class QueueNotFound(QueueError):
    """No System V queue exists with the given key."""


class QueuePermissionDenied(QueueError):
    """The queue exists but this process may not use it that way."""


class QueueFull(QueueError):
    """The queue has no room for the message right now (it may have later)."""


class MessageTooBig(RQPError):
    """A message does not fit in one System V message (kernel ``msgmax``) or a configured limit."""

    def __init__(self, message: str, *, size: int, limit: int):
        super().__init__(message)
        self.size = size
        self.limit = limit


class RecordError(RQPError):
    """A transmission-queue or dead-letter record could not be decoded."""
