"""RQP, the Remote Queues Protocol: System V message queues carried between hosts over TCP.

The layers (ARCHITECTURE.md): :mod:`rqp.protocol` (frames, records, reasons, both state
machines; no I/O), :mod:`rqp.system` (System V queues, files, sockets, services),
:mod:`rqp.storage` (the log store, journal, dedup window, dead-letter archive), :mod:`rqp.config`
and :mod:`rqp.api` (the C-style API), then the agents (:mod:`rqp_agents`), the tools
(:mod:`rqp.tools`) and the report (:mod:`rqp.report`).

Importing ``rqp`` loads only the protocol's constants and errors; the API (and with it
``sysv_ipc``) is imported the first time one of its names is used.
"""

from rqp.protocol.constants import (
    DELIVERED_ERROR, DELIVERED_YES, ERROR_LIMIT, MESSAGE, QUEUE_ASK, QUEUE_NO, QUEUE_YES, SURE_MSG,
    UNSURE_MSG, MessageCode, MessageType,
)
from rqp.protocol.errors import (
    ConfigError, LocalProtocolError, MessageTooBig, ProtocolError, QueueError, QueueFull,
    QueueNotFound, QueuePermissionDenied, RecordError, RemoteProtocolError, RQPError,
)

#: The API's names, imported from :mod:`rqp.api` on first use (PEP 562).
_API = ("AgentStartError", "DataTypeError", "HandleError", "QueueEmpty", "openConnection",
        "sendMessage",
        "closeConnection", "receiveMessage", "beginBatch", "commitBatch", "rollbackBatch",
        "batch", "Batch")

__version__ = "0.1.0"


def _build() -> str:
    """The commit scripts/install built this copy from (the file BUILD it writes beside this
    module), or "": a trial could not tell two builds apart, both "0.1.0"."""
    import os

    try:
        with open(os.path.join(os.path.dirname(__file__), "BUILD"), encoding="utf-8") as f:
            return f.read().strip()[:64]
    except OSError:
        return ""


#: The commit this copy was installed from (scripts/install), "" if unknown.
BUILD = _build()
#: What --version says after the program's name: the version, and the build when known.
VERSION_TEXT = __version__ + (f" (build {BUILD})" if BUILD else "")


def get_include() -> str:
    """The directory holding ``rqp.h``, the header-only C API for producers and consumers
    (as ``numpy.get_include()``): ``cc -I"$(python -m rqp --include)"``."""
    from pathlib import Path

    return str(Path(__file__).resolve().parent / "include")


__all__ = [
    "MESSAGE", "DELIVERED_YES", "DELIVERED_ERROR", "QUEUE_ASK", "QUEUE_YES", "QUEUE_NO",
    "SURE_MSG", "UNSURE_MSG", "ERROR_LIMIT", "MessageCode", "MessageType",
    "RQPError", "ProtocolError", "LocalProtocolError", "RemoteProtocolError", "ConfigError",
    "QueueError", "QueueNotFound", "QueuePermissionDenied", "QueueFull", "MessageTooBig",
    "RecordError", "HandleError", "AgentStartError", "DataTypeError", "QueueEmpty",
    "openConnection", "sendMessage", "closeConnection", "receiveMessage", "get_include",
    "beginBatch", "commitBatch", "rollbackBatch", "batch", "Batch",
]


def __getattr__(name: str):
    if name in _API:
        from rqp import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
