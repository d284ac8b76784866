"""The receiver's authorisation rules (rqp.protocol.access) and the config keys that make them:
``peers``, ``tls``, ``plaintext``, queue patterns in ``offer``, per-host ``tls`` in .rqprc."""

from __future__ import annotations

import ipaddress

import pytest

from rqp.config import HostAddress, receiver_config_from_mapping, sender_config_from_mapping
from rqp.protocol.access import (
    EVERYTHING, Allowance, DeadLetterBudget, Peer, PeerRule, QueueSet, grant_for,
)
from rqp.protocol.errors import ConfigError

TLS = {"cert": "host.crt", "key": "host.key", "ca": "ca.crt"}


def rule(identities=(), networks=(), keys=(), patterns=()) -> PeerRule:
    return PeerRule(tuple(identities), tuple(map(ipaddress.ip_network, networks)),
                    QueueSet(frozenset(keys), tuple(patterns)))


@pytest.mark.parametrize("pattern, name, matches", [
    ("sender-1.prod", "sender-1.prod", True),
    ("SENDER-1.PROD", "sender-1.prod", True),  # DNS names are case-insensitive
    ("*.prod", "a.prod", True),
    ("*.prod", "a.b.prod", False),  # '*' stays within one label, as in certificates
    ("*.prod", "prod", False),
    ("sender-*", "sender-7", True),
    ("sender-*", "sender-7.prod", False),
    ("*", "anything.at.all", True),  # '*' alone: any authenticated peer
    ("a.prod", "a.prod.evil", False),  # whole names only
    ("a.prod", "xa.prod", False),
    ("a?b", "a?b", True), ("a?b", "axb", False),  # only '*' is special
])
def test_identity_patterns(pattern, name, matches):
    assert rule([pattern]).matches(Peer("10.0.0.1", (name,))) is matches


def test_an_identity_rule_never_matches_a_plaintext_peer():
    assert not rule(["*"]).matches(Peer("10.0.0.1"))


@pytest.mark.parametrize("address, matches", [
    ("10.1.2.3", True), ("10.2.0.1", False), ("::ffff:10.1.0.9", True),  # IPv4-mapped
    ("fd00::1", False), ("not-an-address", False),
])
def test_network_rules(address, matches):
    assert rule(networks=["10.1.0.0/16"]).matches(Peer(address)) is matches


def test_identity_and_network_must_both_match_when_both_are_given():
    r = rule(["a.prod"], ["10.1.0.0/16"])
    assert r.matches(Peer("10.1.0.1", ("a.prod",)))
    assert not r.matches(Peer("10.9.0.1", ("a.prod",)))
    assert not r.matches(Peer("10.1.0.1", ("b.prod",)))


def test_first_match_wins_and_no_match_grants_nothing():
    rules = (rule(["a.prod"], keys=[1]), rule(["*.prod"], patterns=["PROD_*"]))
    a, b, stranger = (Peer("10.0.0.1", (n,)) for n in ("a.prod", "b.prod", "x.test"))
    assert grant_for(rules, a).allows(1) and not grant_for(rules, a).allows(2, ["PROD_X"])
    assert grant_for(rules, b).allows(2, ["PROD_X"]) and not grant_for(rules, b).allows(1)
    assert not grant_for(rules, stranger).allows(1)
    assert "no peers rule matches" in grant_for(rules, stranger).describe()
    # no rules at all (peers unset): the transport is the trust; an empty list of rules
    # matches no one (a trial's peers: [] let every peer use every queue)
    assert grant_for(None, stranger) is EVERYTHING
    assert not grant_for((), stranger).allows(99)
    assert "no peers rule matches" in grant_for((), stranger).describe()


def test_a_peer_with_several_names_matches_by_any():
    peer = Peer("10.0.0.1", ("a.test", "a.prod"))
    assert rule(["*.prod"]).matches(peer) and peer.identity == "a.test" == peer.label
    assert Peer("10.0.0.1").label == "10.0.0.1"  # plaintext: the source address


def test_queue_sets_by_key_name_and_pattern():
    s = QueueSet(frozenset({7}), ("PROD_*",))
    assert s.includes(7) and s.includes(8, ["PROD_A"]) and not s.includes(8, ["TEST_A"])
    assert QueueSet(patterns=("*",)).includes(12345)
    assert s.describe() == "PROD_*, 0x00000007"


# --- config -----------------------------------------------------------------------------------

QUEUES = {"PROD_A": 0x101, "PROD_B": 0x102, "TEST_A": 0x201}


def receiver(**data):
    return receiver_config_from_mapping({"queues": QUEUES, **data}, "/etc/rqp/receiver.yaml")


def test_peers_rules_from_the_config():
    cfg = receiver(tls=TLS, peers=[
        {"identity": "*.harvest", "queues": ["PROD_*"]},
        {"identity": ["a.test", "b.test"], "network": "10.0.0.0/8", "queues": ["TEST_A", 0x999]},
    ])
    first, second = cfg.peers
    assert first.identities == ("*.harvest",) and first.queues.patterns == ("PROD_*",)
    assert second.networks == (ipaddress.ip_network("10.0.0.0/8"),)
    assert second.queues.keys == {0x201, 0x999} and second.where == "peers[1]"
    assert cfg.tls.cert == "/etc/rqp/host.crt"  # relative to the config's directory
    assert cfg.tls.name("key") == "/etc/rqp/receiver.yaml: tls.key /etc/rqp/host.key"
    assert receiver(peers=[]).peers == () and receiver().peers is None


@pytest.mark.parametrize("data, key, expected", [
    ({"peers": [{"identity": "a", "queues": ["*"]}]}, "peers[0].identity", "needs TLS"),
    ({"tls": TLS, "peers": [{"queues": ["*"]}]}, "peers[0]", "needs 'identity'"),
    ({"tls": TLS, "peers": [{"identity": "a"}]}, "peers[0].queues", "is required"),
    ({"tls": TLS, "peers": [{"identity": "a", "queues": ["NOPE"]}]}, "peers[0].queues[0]",
     "defined under 'queues'"),
    ({"tls": TLS, "peers": [{"identity": "a b", "queues": ["*"]}]}, "peers[0].identity",
     "expected a TLS identity"),
    ({"peers": [{"network": "10.0.0.0/33", "queues": ["*"]}]}, "peers[0].network", "CIDR"),
    ({"peers": [{"network": "10/8", "quees": ["*"]}]}, "peers[0].quees", "did you mean"),
    ({"peers": {"network": "10.0.0.0/8"}}, "peers", "expected a list of rules"),
    ({"tls": {"cert": "a", "key": "b"}}, "tls.ca", "is required"),
    ({"tls": "yes"}, "tls", "expected a mapping with 'cert'"),
    ({"tls": TLS, "plaintext": True}, "plaintext", "never both"),
    ({"plaintext": "yes"}, "plaintext", "expected true or false (a string here: write it "
     "without quotes)"),
    ({"plaintext": "y"}, "plaintext", "expected true or false (YAML reads"),  # (y is a string)
    ({"plaintext": 1}, "plaintext", "bad value '1': expected true or false"),
    ({"offer": {"allow": ["PROD_*", "bad pattern*"]}}, "offer.allow[1]", "name patterns"),
    ({"offer": {"allow": ["PRDO_*"]}}, "offer.allow[0]", "(a typo?); known names: "),
    ({"tls": {**TLS, "kye": "x"}}, "tls.kye", "unknown key 'tls.kye'"),
])
def test_bad_security_settings_name_the_key(data, key, expected):
    with pytest.raises(ConfigError) as info:
        receiver(**data)
    assert info.value.key == key and expected in str(info.value), str(info.value)


def test_offer_takes_name_patterns():
    cfg = receiver(offer={"allow": ["PROD_*"], "deny": ["PROD_B"]})
    assert [cfg.offers(k) for k in (0x101, 0x102, 0x201)] == [True, False, False]
    assert receiver(offer={"allow": ["*"]}).offers(0x555)
    # never the agents' own queues, whatever the lists say
    assert not receiver(offer={"allow": ["*"]}).offers(0x52510000)


@pytest.mark.parametrize("data, problem", [
    ({}, False),  # default: 127.0.0.1
    ({"listen": "[::1]:7460"}, False),
    ({"listen": ":7460"}, True),
    ({"listen": ":7460", "plaintext": True}, False),
    ({"listen": ":7460", "tls": TLS}, False),
])
def test_plaintext_beyond_loopback_must_be_asked_for(data, problem):
    found = receiver(**data).transport_problem()
    assert bool(found) is problem
    if found:
        assert "plaintext: true" in found and "tls:" in found


def test_sender_tls_per_host():
    cfg = sender_config_from_mapping({
        "tls": TLS,
        "hosts": ["a", {"host": "b:7461", "tls": {"ca": "/other/ca.crt"}},
                  {"host": "c", "tls": False}],
    }, "/etc/rqp/rqprc")
    a, b, c = cfg.hosts
    assert b == HostAddress("b", 7461)
    assert cfg.tls_for(a) == cfg.tls and cfg.tls_for(a).ca == "/etc/rqp/ca.crt"
    assert cfg.tls_for(b).ca == "/other/ca.crt" and cfg.tls_for(b).cert == "/etc/rqp/host.crt"
    assert cfg.tls_for(c) is None
    with pytest.raises(ConfigError, match=r"hosts\[0\]\.tls\.cert' is required"):
        sender_config_from_mapping({"hosts": [{"host": "a", "tls": {"ca": "x"}}]})
    with pytest.raises(ConfigError, match=r"hosts\[0\]\.host' is required"):
        sender_config_from_mapping({"hosts": [{"tls": False}]})
    with pytest.raises(ConfigError, match=r"or false for plaintext"):
        sender_config_from_mapping({"hosts": [{"host": "a", "tls": True}]})


@pytest.mark.parametrize("data, plain", [
    ({"hosts": ["b.example.org"]}, ["b.example.org:7460"]),  # (before: plaintext, unsaid)
    ({"hosts": ["b.example.org", "127.0.0.1", "localhost:7461"]}, ["b.example.org:7460"]),
    ({"hosts": ["b.example.org"], "plaintext": True}, []),
    ({"hosts": [{"host": "b.example.org", "tls": False}, "c"]}, ["c:7460"]),
    ({"hosts": [{"host": "b.example.org", "tls": False}]}, []),
    ({"hosts": ["b.example.org"], "tls": TLS}, []),
    ({"hosts": ["127.0.0.1", "::1"]}, []),
])
def test_a_sender_dials_another_host_in_plaintext_only_when_told(data, plain):
    """Spec section 7: plaintext RQP/1 only where the configuration says so explicitly."""
    problem = sender_config_from_mapping(data, "/etc/rqp/rqprc").transport_problem()
    if not plain:
        assert problem is None
        return
    assert problem.startswith(f"plaintext RQP/1 to {', '.join(plain)} without saying so")
    assert "Give /etc/rqp/rqprc a 'tls:' block" in problem and "'plaintext: true'" in problem


def test_plaintext_and_a_tls_block_in_one_rqprc_is_an_error():
    with pytest.raises(ConfigError, match=r"plaintext.*with a 'tls:' block every host is "
                       r"dialled over TLS"):
        sender_config_from_mapping({"hosts": ["b"], "tls": TLS, "plaintext": True})


def test_dead_letter_budget_per_peer():
    budget = DeadLetterBudget(rate=2.0, burst=3)
    flood = [budget.take("p", 0.0) for _ in range(10)]
    assert flood == [Allowance.FULL] * 3 + [Allowance.HEADER_ONLY] * 3 + [Allowance.NONE] * 4
    assert budget.take("q", 0.0) is Allowance.FULL  # another peer has its own budget
    # in debt (-3), what is repaid (2 tokens/s) buys header-only records at that rate on
    # average: one as soon as the debt is under the burst, each costing a whole token
    assert budget.take("p", 0.5) is Allowance.HEADER_ONLY  # -2 -> -3
    assert budget.take("p", 0.5) is Allowance.NONE
    assert budget.take("p", 0.6) is Allowance.HEADER_ONLY  # -2.8 -> -3.8
    assert budget.take("p", 1.0) is Allowance.NONE  # -3.0
    assert budget.take("p", 1.1) is Allowance.HEADER_ONLY  # -2.8
    assert budget.take("p", 60.0) is Allowance.FULL  # refilled, never beyond the burst
    assert [budget.take("p", 60.0) for _ in range(3)][-1] is Allowance.HEADER_ONLY
    # a dead letter that could not be written is given back: it spent nothing
    spent = DeadLetterBudget(rate=0.0, burst=2)
    for _ in range(5):
        assert spent.take("p", 0.0) is Allowance.FULL
        spent.refund("p")
    spent.refund("p")  # (never beyond the burst)
    assert [spent.take("p", 0.0) for _ in range(3)] == [Allowance.FULL] * 2 + \
        [Allowance.HEADER_ONLY]
    spent.refund("nobody")  # (a peer it does not know: nothing to give back)
    small = DeadLetterBudget(rate=1.0, burst=1, memory=2)
    small.take("a", 0.0), small.take("b", 0.0), small.take("c", 0.0)  # "a" forgotten
    assert small.take("a", 0.0) is Allowance.FULL
