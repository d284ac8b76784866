"""Protocol constants of RQP (spec section 4) and the project's documented defaults."""

from __future__ import annotations

import enum

# Message codes: the first octet of every frame.
MESSAGE = 1
DELIVERED_YES = 2
DELIVERED_ERROR = 3
QUEUE_ASK = 4
QUEUE_YES = 5
QUEUE_NO = 6
# Spec section 6: sent only on a connection where both ends set EXT_MESSAGE.
MESSAGE_EX = 7

# Capability bits of the data octet of QUEUE_ASK / QUEUE_YES / QUEUE_NO (spec section 6).
EXT_MESSAGE = 0x01
#: Every capability this implementation knows.
KNOWN_EXTENSIONS = EXT_MESSAGE
# MESSAGE_EX flags, its priority range and defaults (spec section 6).
BATCH_MORE = 0x01
KNOWN_FLAGS = BATCH_MORE
MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY = 0, 9, 4
#: A batch is at most this many MESSAGE_EX frames.
MAX_BATCH = 256
INT64_MAX = (1 << 63) - 1

# Message types and the error limit.
SURE_MSG = 0
UNSURE_MSG = 1
ERROR_LIMIT = 3


class StateEnum(enum.Enum):
    """The base of the protocol cores' states and events (whose transition tables are dicts
    looked up several times a message): hashed by identity, in C. Enum's own ``__hash__``
    hashes the member's name in Python; its members are singletons compared by identity
    either way."""

    __hash__ = object.__hash__


class MessageCode(enum.IntEnum):
    """The six frame kinds of spec section 4 and ``MESSAGE_EX`` of section 6, by their
    ``message_code``."""

    MESSAGE = MESSAGE
    DELIVERED_YES = DELIVERED_YES
    DELIVERED_ERROR = DELIVERED_ERROR
    QUEUE_ASK = QUEUE_ASK
    QUEUE_YES = QUEUE_YES
    QUEUE_NO = QUEUE_NO
    MESSAGE_EX = MESSAGE_EX


class MessageType(enum.IntEnum):
    SURE = SURE_MSG
    UNSURE = UNSURE_MSG


UINT64_MAX = (1 << 64) - 1
KEY_T_MAX = (1 << 32) - 1  # spec 5.5: a key_t travels in the low 32 bits of the uint64
IPC_PRIVATE = 0

# Decision (spec 5.4): the documented hard cap. The kernel's msgmax is an int, so no System V
# message can be longer than 2**31 - 1 bytes; a MESSAGE claiming more is not a real message and
# the connection that carries it is closed at once.
HARD_MESSAGE_CAP = (1 << 31) - 1

# The documented defaults (README, Configuration; the example files in config/): the one table.
# rqp.config's loaders and the sender core's Settings both read these names.
DEFAULT_PORT = 7460
#: How many queues' figures an agent keeps for rqpctl status and the metrics, the most
#: recently busy; the figures of the others are added up under "forgotten" (the sending MCA:
#: ``rqp.protocol.sender``; the receiving MCA: ``rqp_agents.telemetry.QueueFigures``).
QUEUE_MEMORY = 4096
DEFAULT_TRANSMISSION_QUEUE = 0x52510000  # "RQ" 0000
DEFAULT_DEAD_LETTER_QUEUE = 0x5251DEAD  # "RQ" DEAD
DEAD_LETTER_QUEUE_NAME = "DEAD.LETTER.Q"
TRANSMISSION_QUEUE_NAME = "RQP.XMIT.Q"
DEFAULT_ASK_TIMEOUT = 2.0
DEFAULT_CONFIRM_TIMEOUT = 15.0
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_RETRY_BACKOFF_INITIAL = 0.5
DEFAULT_RETRY_BACKOFF_MAX = 30.0
DEFAULT_WINDOW = 256
DEFAULT_STALL_AFTER = 60.0  # seconds without a confirmation while messages wait: "stalled"
DEFAULT_HEARTBEAT_INTERVAL = 30.0  # a quiet connection with a route is probed this often
DEFAULT_LISTEN_HOST = "127.0.0.1"  # safe default: this host only (issue 12)
ALL_INTERFACES = "0.0.0.0"  # what a listen of ':port' means
DEFAULT_PUT_RETRY_COUNT = 10  # IBM MQ's MRRTY default
DEFAULT_PUT_RETRY_INTERVAL = 1.0  # IBM MQ's MRTMR default
DEFAULT_DEDUP_WINDOW_KEYS = 1_000_000
DEFAULT_DEDUP_WINDOW_AGE = 24 * 3600.0
# The receiving MCA's limits on what the network may hold of it (issue 12).
DEFAULT_MAX_CONNECTIONS = 512  # well under systemd's default 1,024 open files
DEFAULT_MAX_CONNECTIONS_PER_SOURCE = 64
DEFAULT_HANDSHAKE_TIMEOUT = 10.0  # from accept to a finished TLS handshake
DEFAULT_FIRST_FRAME_TIMEOUT = 10.0  # from accept to the first complete frame
DEFAULT_IDLE_TIMEOUT = 600.0  # no frame and nothing in flight for this long: closed
#: The least idle_timeout a receiving MCA takes (less closed connections between frames).
MIN_CONNECTION_TIMEOUT = 0.1
#: A sending MCA takes a receiver's orderly close for its idle time-out, no failure, only if
#: the frames it cut off were sent after the connection had had nothing in flight this long
#: (half the least idle_timeout: the rest for the answer's way back).
QUIET_BEFORE_IDLE_CLOSE = MIN_CONNECTION_TIMEOUT / 2
#: Spill files (full payloads of dead letters too big for one message) kept at most, per agent.
DEFAULT_SPILL_LIMIT = 1 << 30
#: Dead letters a receiving MCA writes for one peer: this many per second on average, this many
#: at once; beyond, as many again header-only, then none (counted): DEAD.LETTER.Q is no weapon.
DEFAULT_DEAD_LETTER_RATE = 10.0
DEFAULT_DEAD_LETTER_BURST = 100

# System V message type (mtype) used for every message the project puts on any queue:
# destination queues, the transmission queue and DEAD.LETTER.Q.
DEFAULT_MTYPE = 1
