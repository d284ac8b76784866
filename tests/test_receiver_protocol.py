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
