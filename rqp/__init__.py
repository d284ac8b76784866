"""RQP, the Remote Queues Protocol: System V message queues carried between hosts over TCP.

The protocol core (:mod:`rqp.frames`, :mod:`rqp.events`) does no I/O; the agents and the
application API wrap it.
"""

from .constants import (
    DELIVERED_ERROR, DELIVERED_YES, ERROR_LIMIT, MESSAGE, QUEUE_ASK, QUEUE_NO, QUEUE_YES, SURE_MSG,
    UNSURE_MSG, MessageCode, MessageType,
)
from .errors import (
    ConfigError, LocalProtocolError, MessageTooBig, ProtocolError, QueueError, QueueFull,
    QueueNotFound, QueuePermissionDenied, RecordError, RemoteProtocolError, RQPError,
)
from .api import (
    AgentStartError, HandleError, closeConnection, openConnection, receiveMessage, sendMessage,
)

__version__ = "0.1.0"

__all__ = [
    "MESSAGE", "DELIVERED_YES", "DELIVERED_ERROR", "QUEUE_ASK", "QUEUE_YES", "QUEUE_NO",
    "SURE_MSG", "UNSURE_MSG", "ERROR_LIMIT", "MessageCode", "MessageType",
    "RQPError", "ProtocolError", "LocalProtocolError", "RemoteProtocolError", "ConfigError",
    "QueueError", "QueueNotFound", "QueuePermissionDenied", "QueueFull", "MessageTooBig",
    "RecordError", "HandleError", "AgentStartError",
    "openConnection", "sendMessage", "closeConnection", "receiveMessage",
]
