"""The receiving MCA's rules (spec 2, 3, 5), fed as bytes: no sockets, no queues."""

from __future__ import annotations

import pytest

import rqp
from rqp import SURE_MSG, UNSURE_MSG
from rqp.protocol.events import DeliveredYes, Message, QueueAsk
from rqp.protocol.frames import CLOSED, NEED_DATA, MESSAGE_HEADER, encode
from rqp.protocol.reasons import ReasonCode
from rqp.protocol.receiver import (
    ANSWERS, TRANSITIONS, Ask, Outcome, Put, ReceiverConnection, Refuse, State,
)

Q1 = 0x52510001


def msg(queue_key=Q1, message_type=SURE_MSG, key=1, body=b"hi") -> bytes:
    return encode(Message(message_type=message_type, key=key, queue_key=queue_key, message=body))


def ask(queue_key=Q1) -> bytes:
    return encode(QueueAsk(queue_key=queue_key))


def test_ask_answered_yes_or_no():
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(ask() + ask(0x999))
    first = conn.next_request()
    assert first == Ask(Q1)
    assert conn.answer_ask(first, True) == b"\x05\x00"
    second = conn.next_request()
    assert conn.answer_ask(second, False) == b"\x06\x00"
    assert conn.next_request() is NEED_DATA
    assert conn.state is State.WAITING_FOR_MESSAGE


def test_invalid_keys_are_never_offered():
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(ask(0) + ask(2**32))
    for _ in range(2):
        assert conn.answer_ask(conn.next_request(), True) == b"\x06\x00"


def test_message_put_or_not():
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(msg(body=b"one") + msg(message_type=UNSURE_MSG, body=b"two"))
    first = conn.next_request()
    assert isinstance(first, Put) and first.message.message == b"one"
    assert conn.answer_put(first, True) == b"\x02\x00"
    second = conn.next_request()
    assert conn.answer_put(second, False) == b"\x03\x00"


def test_answers_strictly_in_order():
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(ask() + msg())
    first = conn.next_request()
    with pytest.raises(rqp.LocalProtocolError, match="not been answered"):
        conn.next_request()
    with pytest.raises(rqp.LocalProtocolError, match="answer_put"):
        conn.answer_put(first, True)
    conn.answer_ask(first, True)
    second = conn.next_request()
    with pytest.raises(rqp.LocalProtocolError, match="is not the request"):
        conn.answer_put(Put(second.message), True)


@pytest.mark.parametrize("queue_key, why", [(0, "IPC_PRIVATE"), (2**32, "does not fit")])
def test_invalid_queue_key_is_refused_and_dead_lettered(queue_key, why):
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(msg(queue_key=queue_key))
    req = conn.next_request()
    assert isinstance(req, Refuse) and req.reason is ReasonCode.INVALID_QUEUE_KEY
    assert why in req.detail and req.dead_letter
    assert conn.answer_put(req, False) == b"\x03\x00"
    with pytest.raises(rqp.LocalProtocolError):
        Refuse(req.message, req.reason, req.detail)  # a new object is not the current request
        conn.answer_put(req, True)


def test_oversized_message_refused_with_header_and_stream_goes_on():
    conn = ReceiverConnection(max_message_size=4)
    conn.receive_data(msg(body=b"0123456789", key=9) + ask())
    req = conn.next_request()
    assert isinstance(req, Refuse) and req.reason is ReasonCode.MESSAGE_TOO_BIG
    assert req.message.key == 9 and req.message.message_length == 10
    assert "max_message_size 4" in req.detail
    assert conn.answer_put(req, False) == b"\x03\x00"
    assert conn.next_request() == Ask(Q1)


def test_messages_behind_a_refused_sure_one_are_held_until_asked_again():
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(msg(key=1) + msg(key=2) + msg(key=3, message_type=UNSURE_MSG)
                      + msg(key=4, queue_key=Q1 + 1) + ask() + msg(key=2))
    first = conn.next_request()
    conn.answer_put(first, False)  # e.g. queue full
    held = conn.next_request()
    assert isinstance(held, Refuse) and not held.dead_letter and held.message.key == 2
    conn.answer_put(held, False)
    # UNSURE ones are held too (putting one would overtake the SURE retry, spec 5.8), and
    # dead-lettered: the sender will not send them again.
    unsure = conn.next_request()
    assert isinstance(unsure, Refuse) and unsure.dead_letter and unsure.message.key == 3
    assert unsure.reason is ReasonCode.PUT_FAILED and "keep the order" in unsure.detail
    conn.answer_put(unsure, False)
    other = conn.next_request()  # other queue keys are not held
    assert isinstance(other, Put)
    conn.answer_put(other, True)
    conn.answer_ask(conn.next_request(), True)
    again = conn.next_request()  # after QUEUE_ASK the sender's retry is put again
    assert isinstance(again, Put) and again.message.key == 2


def test_protocol_errors_and_close():
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(b"\x02\x00")
    with pytest.raises(rqp.RemoteProtocolError, match="unexpected DELIVERED_YES"):
        conn.next_request()
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(msg()[:10])
    assert conn.next_request() is NEED_DATA
    conn.receive_data(b"")
    with pytest.raises(rqp.RemoteProtocolError, match="stream closed inside a MESSAGE"):
        conn.next_request()
    conn = ReceiverConnection(max_message_size=100)
    conn.receive_data(b"")
    assert conn.next_request() is CLOSED


def test_claim_over_hard_cap_closes():
    conn = ReceiverConnection(max_message_size=8192)
    conn.receive_data(MESSAGE_HEADER.build({"message_type": 0, "key": 1, "queue_key": Q1,
                                            "message_length": 2**63}))
    with pytest.raises(rqp.RemoteProtocolError, match="hard cap"):
        conn.next_request()


def test_transition_table_is_the_seed_diagram():
    assert {s.value for s in State} == {
        "Waiting for message", "Sending delivered_yes", "Sending queue_yes", "Sending queue_no",
        "Sending delivered error and putting message to DEAD.LETTER.Q"}
    waiting = TRANSITIONS[State.WAITING_FOR_MESSAGE]
    assert set(waiting.values()) == set(ANSWERS)
    for state in ANSWERS:
        assert TRANSITIONS[state] == {Outcome.ANSWER_SENT: State.WAITING_FOR_MESSAGE}
    assert ANSWERS[State.SENDING_DELIVERED_YES] == DeliveredYes()


# --- extensions (spec section 6): negotiation and batches -----------------------------------

from rqp.protocol.events import MessageEx  # noqa: E402
from rqp.protocol.receiver import Batch  # noqa: E402


def ask_bits(bits: int, queue_key=Q1) -> bytes:
    return encode(QueueAsk(queue_key=queue_key, data=bits))


def msg_ex(key=1, flags=0, queue_key=Q1, mtype=5, message_type=SURE_MSG, body=b"hi") -> bytes:
    return encode(MessageEx(message_type=message_type, key=key, queue_key=queue_key,
                            message=body, mtype=mtype, flags=flags))


@pytest.mark.parametrize("ours, theirs, agreed", [(1, 1, 1), (0, 1, 0), (1, 0, 0), (1, 0xFF, 1)])
def test_the_first_answer_fixes_the_bits_for_the_connection(ours, theirs, agreed):
    conn = ReceiverConnection(max_message_size=100, extensions=ours)
    conn.receive_data(ask_bits(theirs) + ask_bits(0, 0x999))
    first = conn.next_request()
    assert first == Ask(Q1, theirs)
    assert conn.answer_ask(first, True) == bytes((5, agreed))  # unknown bits: never echoed
    # every later answer on the connection carries the same bits, QUEUE_NO too
    assert conn.answer_ask(conn.next_request(), False) == bytes((6, agreed))
    assert conn.agreed == agreed


def test_a_plain_peer_sees_plain_rqp1_bytes():
    conn = ReceiverConnection(max_message_size=100, extensions=1)
    conn.receive_data(ask() + msg())
    assert conn.answer_ask(conn.next_request(), True) == b"\x05\x00"
    assert conn.answer_put(conn.next_request(), True) == b"\x02\x00"


def test_message_ex_before_the_bit_was_answered_is_a_protocol_error():
    conn = ReceiverConnection(max_message_size=100, extensions=1)
    conn.receive_data(msg_ex())
    with pytest.raises(rqp.RemoteProtocolError, match="unexpected MESSAGE_EX"):
        conn.next_request()
    plain = ReceiverConnection(max_message_size=100, extensions=1)  # asked without the bit
    plain.receive_data(ask() + msg_ex())
    plain.answer_ask(plain.next_request(), True)
    with pytest.raises(rqp.RemoteProtocolError, match="unexpected MESSAGE_EX"):
        plain.next_request()


def negotiated(**kw) -> ReceiverConnection:
    conn = ReceiverConnection(max_message_size=kw.pop("max_message_size", 100), extensions=1)
    conn.receive_data(ask_bits(1))
    conn.answer_ask(conn.next_request(), True)
    return conn


def test_a_single_message_ex_is_a_put_carrying_its_mtype():
    conn = negotiated()
    conn.receive_data(msg_ex(mtype=42))
    put = conn.next_request()
    assert isinstance(put, Put) and put.message.mtype == 42
    assert conn.answer_put(put, True) == b"\x02\x00"


def test_a_batch_comes_out_whole_and_is_answered_all_at_once():
    conn = negotiated()
    frames = msg_ex(key=1, flags=1) + msg_ex(key=2, flags=1) + msg_ex(key=3)
    for octet in frames[:-1]:  # nothing of the batch before its last octet
        conn.receive_data(bytes([octet]))
        assert conn.next_request() is NEED_DATA
    conn.receive_data(frames[-1:])
    batch = conn.next_request()
    assert isinstance(batch, Batch) and batch.refused is None
    assert [m.key for m in batch.messages] == [1, 2, 3]
    assert conn.answer_batch(batch, True) == b"\x02\x00" * 3
    conn.receive_data(msg_ex(key=4, flags=1) + msg_ex(key=5))
    assert conn.answer_batch(conn.next_request(), False) == b"\x03\x00" * 2


def test_a_batch_with_one_undeliverable_message_is_refused_whole():
    conn = negotiated(max_message_size=10)
    conn.receive_data(msg_ex(key=1, flags=1) + msg_ex(key=2, flags=1, body=b"x" * 50)
                      + msg_ex(key=3))
    batch = conn.next_request()
    assert batch.refused is not None and batch.refused.reason is ReasonCode.MESSAGE_TOO_BIG
    assert len(batch.messages) == 3
    with pytest.raises(rqp.LocalProtocolError, match="cannot have been delivered"):
        conn.answer_batch(batch, True)
    assert conn.answer_batch(batch, False) == b"\x03\x00" * 3


def test_an_unfinished_batch_holds_at_most_max_message_size_octets_of_data():
    """A batch is one System V message at its sender: its messages together may bring no more
    than one message's max_message_size. Beyond it a frame's body is not kept (a trial held
    256 x max_message_size per connection with batches it never finished), and the batch is
    refused whole, MESSAGE_TOO_BIG."""
    conn = negotiated(max_message_size=100)
    conn.receive_data(msg_ex(key=1, flags=1, body=b"a" * 60)
                      + msg_ex(key=2, flags=1, body=b"b" * 40))
    assert conn.next_request() is NEED_DATA  # 100 octets: all kept, nothing more may come
    conn.receive_data(msg_ex(key=3, flags=1, body=b"c" * 100))  # its body is skipped
    assert conn.next_request() is NEED_DATA and conn.decoder.buffered == 0
    for key in range(4, 200):  # more of the same: nothing more held
        conn.receive_data(msg_ex(key=key, flags=1, body=b"d" * 100))
        assert conn.next_request() is NEED_DATA and conn.decoder.buffered == 0
    conn.receive_data(msg_ex(key=200))  # (an empty last message fits)
    batch = conn.next_request()
    assert isinstance(batch, Batch) and len(batch.messages) == 200
    assert [type(m).__name__ for m in batch.messages[:3]] == \
        ["MessageEx", "MessageEx", "OversizedMessage"]
    assert batch.refused.message.key == 3 and batch.refused.reason is ReasonCode.MESSAGE_TOO_BIG
    assert batch.refused.detail == ("message_length 100 takes its batch over this receiver's "
                                    "max_message_size 100 octets for the messages of a batch "
                                    "together (100 before it)")
    assert conn.answer_batch(batch, False) == b"\x03\x00" * 200
    conn.receive_data(ask_bits(1))  # (the sender asks again before it sends that queue more)
    conn.answer_ask(conn.next_request(), True)
    conn.receive_data(msg_ex(key=201, body=b"e" * 100))  # the next request: the whole limit
    put = conn.next_request()
    assert isinstance(put, Put) and put.message.message == b"e" * 100


def test_a_batch_within_max_message_size_in_all_is_taken():
    conn = negotiated(max_message_size=100)
    conn.receive_data(msg_ex(key=1, flags=1, body=b"a" * 50) + msg_ex(key=2, body=b"b" * 50))
    batch = conn.next_request()
    assert batch.refused is None and [len(m.message) for m in batch.messages] == [50, 50]


@pytest.mark.parametrize("stream, error", [
    (lambda: msg_ex(flags=1) + ask(), "a QUEUE_ASK frame inside a batch"),
    (lambda: msg_ex(flags=1) + msg(), "a MESSAGE frame inside a batch"),
    (lambda: msg_ex(flags=1) * 257, "more than 256"),
])
def test_a_broken_batch_is_a_protocol_error(stream, error):
    conn = negotiated()
    conn.receive_data(stream())
    with pytest.raises(rqp.RemoteProtocolError, match=error):
        conn.next_request()


def test_a_stream_ending_inside_a_batch_is_a_protocol_error():
    conn = negotiated()
    conn.receive_data(msg_ex(flags=1))
    assert conn.next_request() is NEED_DATA
    conn.receive_data(b"")
    with pytest.raises(rqp.RemoteProtocolError, match="inside a batch"):
        conn.next_request()


def test_the_core_makes_its_puts_without_the_dataclass_init_and_they_are_puts():
    """next_request() builds each Put without the frozen dataclass' __init__: the same object,
    and Put has no other field it would leave unset."""
    import dataclasses

    from rqp.protocol.events import Message
    from rqp.protocol.receiver import Put, _new_put

    assert [f.name for f in dataclasses.fields(Put)] == ["message"]
    message = Message(message_type=SURE_MSG, key=7, queue_key=0x5151, message=b"m")
    made = _new_put(message)
    assert type(made) is Put and made == Put(message) and made.message is message
