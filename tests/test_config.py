"""Tests of rqp.config: the .rqprc and receiver config files, their search and their errors."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rqp import config
from rqp.config import (
    MAX_DURATION,
    RECEIVER_KEYS,
    SENDER_KEYS,
    HostAddress,
    ReceiverConfig,
    SenderConfig,
    default_state_dir,
    find_rqprc,
    load_receiver_config,
    load_sender_config,
    parse_duration,
    parse_host,
    parse_queue_key,
    parse_size,
    receiver_config_from_mapping,
    sender_config_from_mapping,
)
from rqp.protocol.constants import (
    DEFAULT_DEAD_LETTER_QUEUE,
    DEFAULT_PORT,
    DEFAULT_TRANSMISSION_QUEUE,
    HARD_MESSAGE_CAP,
)
from rqp.protocol.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"
SENDER_EXAMPLES = sorted(CONFIG_DIR.glob("*rqprc*.yaml"))
RECEIVER_EXAMPLES = sorted(CONFIG_DIR.glob("receiver*.yaml"))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def load_sender(tmp_path: Path, text: str) -> SenderConfig:
    return load_sender_config(write(tmp_path / ".rqprc", text), env={}, home=tmp_path)


def load_receiver(tmp_path: Path, text: str) -> ReceiverConfig:
    return load_receiver_config(write(tmp_path / "receiver.yaml", text), env={}, home=tmp_path)


def sender_error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_sender(tmp_path, text)
    return info.value


def receiver_error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_receiver(tmp_path, text)
    return info.value


# --------------------------------------------------------------------------------------------
# The examples in config/


def test_the_examples_are_there() -> None:
    assert len(SENDER_EXAMPLES) >= 2
    assert len(RECEIVER_EXAMPLES) >= 2


@pytest.mark.parametrize("path", SENDER_EXAMPLES, ids=lambda p: p.name)
def test_sender_example_loads(path: Path, tmp_path: Path) -> None:
    cfg = load_sender_config(path, env={}, home=tmp_path)
    assert cfg.hosts
    assert cfg.source == str(path)


@pytest.mark.parametrize("path", RECEIVER_EXAMPLES, ids=lambda p: p.name)
def test_receiver_example_loads(path: Path, tmp_path: Path) -> None:
    cfg = load_receiver_config(path, env={}, home=tmp_path)
    assert cfg.source == str(path)


@pytest.mark.parametrize(
    ("name", "keys"), [("rqprc.example.yaml", SENDER_KEYS), ("receiver.example.yaml", RECEIVER_KEYS)]
)
def test_full_examples_show_every_key(name: str, keys: tuple[str, ...]) -> None:
    data = yaml.safe_load((CONFIG_DIR / name).read_text())
    assert sorted(data) == sorted(keys)


# --------------------------------------------------------------------------------------------
# Where .rqprc is found

PLACES = ("explicit", "RQPRC", "cwd", "home", "system")


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    files = {
        "explicit": tmp_path / "explicit.yaml",
        "RQPRC": tmp_path / "env.yaml",
        "cwd": tmp_path / "cwd" / ".rqprc",
        "home": tmp_path / "home" / ".rqprc",
        "system": tmp_path / "etc" / "rqp" / "rqprc",
    }
    for directory in ("cwd", "home"):
        files[directory].parent.mkdir()
    monkeypatch.setattr(config, "SYSTEM_RQPRC", files["system"])
    return files


@pytest.mark.parametrize("winner", range(len(PLACES)), ids=PLACES)
def test_each_place_wins_over_the_later_ones(places: dict[str, Path], winner: int) -> None:
    for i, place in enumerate(PLACES[winner:], start=winner):
        write(places[place], f"hosts: [host{i}]\n")
    env = {"RQPRC": str(places["RQPRC"])} if winner <= 1 else {}
    explicit = places["explicit"] if winner == 0 else None
    cwd, home = places["cwd"].parent, places["home"].parent

    assert find_rqprc(explicit, env=env, cwd=cwd, home=home) == places[PLACES[winner]]
    cfg = load_sender_config(explicit, env=env, cwd=cwd, home=home)
    assert cfg.hosts == (HostAddress(f"host{winner}", DEFAULT_PORT),)
    assert cfg.source == str(places[PLACES[winner]])


def test_home_comes_from_the_environment(places: dict[str, Path]) -> None:
    write(places["home"], "hosts: [a]\n")
    env = {"HOME": str(places["home"].parent)}
    assert find_rqprc(env=env, cwd=places["cwd"].parent) == places["home"]


def test_relative_paths_are_relative_to_cwd(places: dict[str, Path]) -> None:
    cwd = places["cwd"].parent
    write(cwd / "sub" / "x.yaml", "hosts: [a]\n")
    assert find_rqprc("sub/x.yaml", env={}, cwd=cwd) == cwd / "sub" / "x.yaml"
    assert find_rqprc(env={"RQPRC": "sub/x.yaml"}, cwd=cwd) == cwd / "sub" / "x.yaml"


def test_missing_explicit_file_is_an_error(places: dict[str, Path]) -> None:
    write(places["cwd"], "hosts: [a]\n")  # must not be used instead
    with pytest.raises(ConfigError, match="no such file \\(given explicitly\\)") as info:
        find_rqprc(places["explicit"], env={}, cwd=places["cwd"].parent)
    assert str(places["explicit"]) in str(info.value)


def test_missing_rqprc_from_environment_is_an_error(places: dict[str, Path]) -> None:
    write(places["cwd"], "hosts: [a]\n")
    env = {"RQPRC": str(places["RQPRC"])}
    with pytest.raises(ConfigError, match="no such file \\(named by \\$RQPRC\\)") as info:
        load_sender_config(env=env, cwd=places["cwd"].parent)
    assert str(places["RQPRC"]) in str(info.value)


def test_empty_rqprc_variable_is_ignored(places: dict[str, Path]) -> None:
    write(places["cwd"], "hosts: [a]\n")
    assert find_rqprc(env={"RQPRC": ""}, cwd=places["cwd"].parent) == places["cwd"]


def test_explicit_directory_is_an_error(places: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="is not a file"):
        find_rqprc(places["cwd"].parent, env={})


def test_nothing_found_lists_every_place(places: dict[str, Path]) -> None:
    cwd, home = places["cwd"].parent, places["home"].parent
    with pytest.raises(ConfigError) as info:
        find_rqprc(env={}, cwd=cwd, home=home)
    message = str(info.value)
    assert message.startswith("no .rqprc found")
    for text in ("$RQPRC", str(places["cwd"]), str(places["home"]), str(places["system"])):
        assert text in message


def test_search_order_constant_names_every_place() -> None:
    assert len(config.RQPRC_SEARCH_ORDER) == 5
    assert config.RQPRC_SEARCH_ORDER[1:4] == ("$RQPRC", "./.rqprc", "~/.rqprc")


def test_receiver_config_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_receiver_config(tmp_path / "nope.yaml")


# --------------------------------------------------------------------------------------------
# Values that load


def test_sender_defaults(tmp_path: Path) -> None:
    cfg = load_sender(tmp_path, "hosts: [rqp1]\n")
    assert cfg.hosts == (HostAddress("rqp1", 7460),)
    assert (cfg.port, cfg.error_limit, cfg.window) == (7460, 3, 256)
    assert cfg.transmission_queue == DEFAULT_TRANSMISSION_QUEUE
    assert cfg.dead_letter_queue == DEFAULT_DEAD_LETTER_QUEUE
    assert (cfg.ask_timeout, cfg.confirm_timeout, cfg.connect_timeout) == (2.0, 15.0, 2.0)
    assert (cfg.retry_backoff_initial, cfg.retry_backoff_max) == (0.5, 30.0)
    assert dict(cfg.queues) == {}


def test_sender_values(tmp_path: Path) -> None:
    cfg = load_sender(
        tmp_path,
        """
hosts: [a, 'b:1', '192.0.2.1:2', '[2001:db8::1]:3', '[::1]', '::2']
port: 9000
transmission_queue: '0x10'
dead_letter_queue: -2
ask_timeout: 250 ms
confirm_timeout: 1m
connect_timeout: 0.5
error_limit: 5
window: 65536
retry_backoff_initial: 1s
retry_backoff_max: 1s
queues:
  PROD_THE_SCHED_COMMON: 0x52510001
  ALIAS: 1381040129
""",
    )
    assert [str(h) for h in cfg.hosts] == [
        "a:9000", "b:1", "192.0.2.1:2", "[2001:db8::1]:3", "[::1]:9000", "[::2]:9000",
    ]
    assert (cfg.transmission_queue, cfg.dead_letter_queue) == (16, 0xFFFFFFFE)
    assert (cfg.ask_timeout, cfg.confirm_timeout, cfg.connect_timeout) == (0.25, 60.0, 0.5)
    assert (cfg.error_limit, cfg.window) == (5, 65536)
    assert dict(cfg.queues) == {"PROD_THE_SCHED_COMMON": 0x52510001, "ALIAS": 0x52510001}


def test_configs_are_frozen_and_hashable(tmp_path: Path) -> None:
    cfg = load_sender(tmp_path, "hosts: [a]\nqueues: {A: 1}\n")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.queues["B"] = 2  # type: ignore[index]
    assert hash(cfg) == hash(load_sender(tmp_path, "hosts: [a]\nqueues: {A: 1}\n"))
    hash(ReceiverConfig())


def test_broadcast_names(tmp_path) -> None:
    from rqp.protocol.keys import is_broadcast_name
    assert [n for n in ("PROD_ALL_BA_TWO", "ALL_BA", "PROD_ANY_BA", "PROD_THE_ALL_X", "PROD_ALL",
                        "PROD_ALLX_BA", "CALL_BA", "ALL", "prod_all_ba") if is_broadcast_name(n)] \
        == ["PROD_ALL_BA_TWO", "ALL_BA", "prod_all_ba"]
    cfg = load_sender(tmp_path, "hosts: [a]\nqueues: {PROD_ALL_BA: 5, ALIAS_ALL_BA: 5, "
                                "PROD_THE_BA: 6}\n")
    assert cfg.broadcast_keys == frozenset({5})
    err = sender_error(tmp_path, "hosts: [a]\nqueues: {PROD_ALL_BA: 5, PROD_THE_BA: 5}\n")
    assert "queues.PROD_THE_BA" in str(err) and "PROD_ALL_BA is a broadcast name" in str(err)
    assert "'0x00000005'" in str(err)  # the key as keys are written


def test_resolve_queue_and_queue_name() -> None:
    cfg = sender_config_from_mapping(
        {"hosts": ["a"], "queues": {"A": 1, "B": 1, "C": 0xFFFFFFFF}, "dead_letter_queue": 7}
    )
    assert cfg.resolve_queue("A") == cfg.resolve_queue("B") == 1
    assert cfg.resolve_queue("DEAD.LETTER.Q") == 7
    assert cfg.resolve_queue("RQP.XMIT.Q") == DEFAULT_TRANSMISSION_QUEUE
    assert cfg.resolve_queue("0x10") == cfg.resolve_queue(16) == 16
    assert cfg.queue_name(1) == "A"
    assert cfg.queue_name(-1) == "C"
    assert cfg.queue_name(7) == "DEAD.LETTER.Q"
    assert cfg.queue_name(DEFAULT_TRANSMISSION_QUEUE) == "RQP.XMIT.Q"
    assert cfg.queue_name(99) is None
    with pytest.raises(ConfigError, match="did you mean 'C'"):
        cfg.resolve_queue("c")


def test_receiver_defaults(tmp_path: Path) -> None:
    for cfg in (load_receiver_config(), load_receiver(tmp_path, ""), load_receiver(tmp_path, "# nothing\n")):
        assert cfg.listen == HostAddress("127.0.0.1", 7460)  # this host only
        assert cfg.dead_letter_queue == DEFAULT_DEAD_LETTER_QUEUE
        assert cfg.max_message_size is None
        assert (cfg.put_retry_count, cfg.put_retry_interval) == (10, 1.0)
        assert cfg.host_name is None
        assert cfg.offers(1) and not cfg.offers(0) and not cfg.offers(1 << 32)
        assert not cfg.offers(DEFAULT_DEAD_LETTER_QUEUE)  # never: it is where refusals go
    assert load_receiver_config().source is None


def test_receiver_values(tmp_path: Path) -> None:
    cfg = load_receiver(
        tmp_path,
        """
listen: '[::]:7461'
dead_letter_queue: 0x99
max_message_size: 64 KiB
queues: {A: 1, B: 2, C: 3}
offer:
  allow: [A, B, 4, DEAD.LETTER.Q]
  deny: [B]
put_retry_count: 0
put_retry_interval: 200ms
host_name: rqp1.example.org
""",
    )
    assert cfg.listen == HostAddress("::", 7461)
    assert cfg.max_message_size == 65536
    assert cfg.offer_allow.keys == {1, 2, 4, 0x99} and not cfg.offer_allow.patterns
    assert [k for k in range(1, 6) if cfg.offers(k)] == [1, 4]
    assert not cfg.offers(0x99)  # listed, yet never offered: the dead-letter queue
    assert (cfg.put_retry_count, cfg.put_retry_interval, cfg.host_name) == (0, 0.2, "rqp1.example.org")
    assert cfg.resolve_queue("DEAD.LETTER.Q") == 0x99
    assert cfg.queue_name(2) == "B"


def test_receiver_deny_only_and_empty_allow() -> None:
    cfg = receiver_config_from_mapping({"offer": {"deny": [5]}})
    assert cfg.offers(4) and not cfg.offers(5)
    assert not receiver_config_from_mapping({"offer": {"allow": []}}).offers(4)


def test_listen_forms() -> None:
    cases = [(":7461", ("0.0.0.0", 7461)), ("localhost", ("localhost", 7460)),
             ("10.0.0.1:1", ("10.0.0.1", 1)),
             ("::", ("::", 7460)), ("[::1]:9", ("::1", 9)), (" :1 ", ("0.0.0.0", 1))]
    for value, expected in cases:
        assert tuple(receiver_config_from_mapping({"listen": value}).listen) == expected, value


# --------------------------------------------------------------------------------------------
# The state directory


def test_relative_state_dir_is_relative_to_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "etc" / "rqprc", "hosts: [a]\nstate_dir: ../var/state\n")
    assert load_sender_config(path, env={}).state_dir == str(tmp_path / "var" / "state")
    path = write(tmp_path / "etc" / "receiver.yaml", "state_dir: state\n")
    assert load_receiver_config(path, env={}).state_dir == str(tmp_path / "etc" / "state")


def test_state_dir_tilde_and_absolute(tmp_path: Path) -> None:
    assert load_sender(tmp_path, "hosts: [a]\nstate_dir: ~/st\n").state_dir == str(tmp_path / "st")
    assert load_sender(tmp_path, "hosts: [a]\nstate_dir: /x//y/\n").state_dir == "/x/y"


def test_state_dir_of_a_mapping_is_relative_to_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert sender_config_from_mapping({"hosts": ["a"], "state_dir": "s"}).state_dir == str(tmp_path / "s")


def test_default_state_dir() -> None:
    assert default_state_dir({"STATE_DIRECTORY": "/a:/b"}, euid=1000) == "/a"
    assert default_state_dir({"STATE_DIRECTORY": "/a"}, euid=0) == "/a"
    assert default_state_dir({}, euid=0) == "/var/lib/rqp"
    assert default_state_dir({"XDG_STATE_HOME": "/x"}, euid=1000) == "/x/rqp"
    assert default_state_dir({"XDG_STATE_HOME": "rel"}, euid=1000, home="/h") == "/h/.local/state/rqp"
    assert default_state_dir({"HOME": "/h"}, euid=1000) == "/h/.local/state/rqp"


def test_state_dir_default_is_used_when_unset(tmp_path: Path) -> None:
    path = write(tmp_path / ".rqprc", "hosts: [a]\n")
    assert load_sender_config(path, env={"STATE_DIRECTORY": "/run/s"}).state_dir == "/run/s"
    assert receiver_config_from_mapping(None, env={"STATE_DIRECTORY": "/run/r"}).state_dir == "/run/r"


# --------------------------------------------------------------------------------------------
# Malformed files: every message names the file, the key, the value and what was expected

STATE_DIR_EXPECTED = "expected a directory path (a relative one starts at the config file's directory)"
SENDER_ERRORS = [
    # (the file after 'hosts: [a]', key, the value as shown, expected)
    ("ask_timeout: -1", "ask_timeout", "'-1'", "expected a positive duration in seconds"),
    ("ask_timeout: 0", "ask_timeout", "'0'", "expected a positive duration"),
    ("ask_timeout: yes", "ask_timeout", "'true'", "YAML reads yes/no/on/off/true/false as booleans"),
    ("confirm_timeout: 2x", "confirm_timeout", "'2x'", "'500ms'"),
    ("confirm_timeout: 1e3", "confirm_timeout", "'1e3'", "not in exponent form"),
    # (a trial: 1.0e9 was called "not a positive duration"; YAML reads it as text)
    ("stall_after: 1.0e9", "stall_after", "'1.0e9'", "expected a duration written out, not in "
     "exponent form"),
    ("connect_timeout: .inf", "connect_timeout", "'inf'", "at most 31536000 s (a year)"),
    ("connect_timeout: -2s", "connect_timeout", "'-2s'", "expected a positive duration"),
    ("connect_timeout: 1000000000", "connect_timeout", "'1000000000'", "at most 31536000 s (a year)"),
    ("retry_backoff_initial: [1]", "retry_backoff_initial", "'[1]'", "expected a positive duration"),
    ("retry_backoff_max: 100ms", "retry_backoff_max", "'100ms'", ">= retry_backoff_initial (0.5 s)"),
    ("retry_backoff_initial: 1m", "retry_backoff_initial", "'1m'", "<= retry_backoff_max (30 s)"),
    ("port: 0", "port", "'0'", "expected a TCP port: an integer 1..65535"),
    ("port: 65536", "port", "'65536'", "1..65535"),
    ("port: '7460'", "port", "'7460'", "an integer 1..65535 (a string here: write it without quotes)"),
    ("window: '256'", "window", "'256'", "(a string here: write it without quotes)"),
    ("port: on", "port", "'true'", "booleans"),
    ("error_limit: 0", "error_limit", "'0'", "an integer >= 1"),
    ("error_limit: 1.5", "error_limit", "'1.5'", "an integer >= 1"),
    ("window: 0", "window", "'0'", "an integer 1..65536"),
    ("window: 65537", "window", "'65537'", "an integer 1..65536"),
    ("transmission_queue: 0", "transmission_queue", "'0'", "0 is IPC_PRIVATE: it names no queue"),
    ("transmission_queue: 0x0", "transmission_queue", "'0'", "IPC_PRIVATE"),
    ("transmission_queue: '-0x0'", "transmission_queue", "'-0x0'", "IPC_PRIVATE"),
    ("transmission_queue: 0x100000000", "transmission_queue", "'4294967296'", "1..4294967295"),
    ("transmission_queue: -2147483649", "transmission_queue", "'-2147483649'", "-2147483648..-1"),
    ("transmission_queue: '08'", "transmission_queue", "'08'", "System V queue key"),
    ("transmission_queue: 1.5", "transmission_queue", "'1.5'", "System V queue key"),
    ("transmission_queue: true", "transmission_queue", "'true'", "booleans"),
    ("dead_letter_queue: PROD_X", "dead_letter_queue", "'PROD_X'", "a queue name cannot be used here"),
    ("dead_letter_queue: 0x52510000", "dead_letter_queue", "'0x52510000'",  # (a trial: the
     "other than transmission_queue's (0x52510000)"),                      # key in decimal)
    ("transmission_queue: 0x5251DEAD", "transmission_queue", "'0x5251dead'",
     "other than dead_letter_queue's (0x5251dead)"),
    ("queues: {A: 0}", "queues.A", "'0'", "IPC_PRIVATE"),
    ("queues: {A: B}", "queues.A", "'B'", "a queue name cannot be used here"),
    ("queues: {A: 4294967296}", "queues.A", "'4294967296'", "1..4294967295"),
    ("queues: {1A: 1}", "queues.1A", "'1A'", "expected a queue name matching"),
    ("queues: {'A B': 1}", "queues.A B", "'A B'", "expected a queue name matching"),
    ("queues: {DEAD.LETTER.Q: 5}", "queues.DEAD.LETTER.Q", "'DEAD.LETTER.Q'", "built in"),
    ("queues: {RQP.XMIT.Q: 5}", "queues.RQP.XMIT.Q", "'RQP.XMIT.Q'", "cannot be redefined"),
    ("queues: [A]", "queues", "\"['A']\"", "expected a mapping of queue names to keys"),
    ("queues: {PROD_ONE: 0x5251DEAD}", "queues.PROD_ONE", "'0x5251dead'",  # (a trial)
     "0x5251dead is this agent's dead_letter_queue (DEAD.LETTER.Q), which no receiving MCA"),
    ("queues: {PROD_ONE: 0x52510000}", "queues.PROD_ONE", "'0x52510000'",
     "0x52510000 is this agent's transmission_queue"),
    ("state_dir: 5", "state_dir", "'5'", STATE_DIR_EXPECTED),
    ("state_dir: ''", "state_dir", "''", STATE_DIR_EXPECTED),
]


def test_sender_errors(tmp_path: Path) -> None:
    path = str(tmp_path / ".rqprc")
    for line, key, shown, expected in SENDER_ERRORS:
        error = sender_error(tmp_path, f"hosts: [a]\n{line}\n")
        message = str(error)
        assert message.startswith(f"{path}: key {key!r}: bad value {shown}: "), (line, message)
        assert expected in message, (line, message)
        assert (error.path, error.key) == (path, key), line


def test_a_key_yaml_reads_as_another_type_is_named_with_its_line(tmp_path: Path) -> None:
    """Left alone a round ago: a queue named ``yes`` (YAML's True) was refused without the
    line, as its line was kept under 'yes' and the error names 'True'."""
    for key, name in (("yes", "True"), ("0x10", "16"), ("~", "None")):
        error = sender_error(tmp_path, f"hosts: [a]\nqueues:\n  GOOD: 0x52510001\n  {key}: 5\n")
        assert str(error).endswith("(line 4)"), (key, str(error))
        assert error.key == f"queues.{name}", (key, error.key)


def test_a_config_behind_a_directory_it_cannot_search_is_a_config_error(tmp_path: Path) -> None:
    """A trial: a config whose directory could not be searched raised PermissionError out of
    a reload (exit status 70). Run as uid 65534, as an agent's user would be."""
    tmp_path.chmod(0o755)
    hidden = tmp_path / "cfg"
    hidden.mkdir()
    (hidden / "rqprc").write_text("hosts: [a]\n")
    (hidden / "r.yaml").write_text("plaintext: true\n")
    home = Path(tempfile.mkdtemp(prefix="rqp-home-", dir="/tmp"))  # (65534 may search it)
    home.chmod(0o755)
    (home / ".rqprc").write_text("hosts: [a]\n")  # (a HOME's, after the hidden ./.rqprc)
    (home / ".rqprc").chmod(0o644)
    hidden.chmod(0)
    script = (
        "import sys\nfrom rqp import config\n"
        "for load in (config.load_sender_config, config.load_receiver_config):\n"
        "    try: load(sys.argv[1] + '/' + ('rqprc' if load is config.load_sender_config "
        "else 'r.yaml'))\n"
        "    except config.ConfigError as exc: print(exc)\n"
        "for home in sys.argv[1:]:\n"
        "    try: config.load_sender_config(env={'HOME': home}, cwd=sys.argv[1])\n"
        "    except config.ConfigError as exc: print(exc)\n")
    try:
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               sys.executable, "-c", script, str(hidden), str(home)],
                              capture_output=True, text=True, timeout=60,
                              cwd=Path(config.__file__).parent.parent)
    finally:
        hidden.chmod(0o755)
        shutil.rmtree(home)
    assert done.returncode == 0 and done.stdout.splitlines() == [
        f"{hidden}/rqprc: cannot read the file: Permission denied (given explicitly)",
        f"{hidden}/r.yaml: cannot read the file: Permission denied",
        # ./.rqprc that cannot be looked at is said, not passed over for another; with no
        # other, it is none (a trial's drain, with its receiver config, was refused on it)
        f"no .rqprc found; looked at: $RQPRC (not set), {hidden}/.rqprc (Permission denied), "
        "/etc/rqp/rqprc",  # (./.rqprc is ~/.rqprc here: looked at once)
        f"{hidden}/.rqprc: cannot read the file: Permission denied (the .rqprc looked at "
        f"before {home}/.rqprc)",
    ], done.stdout + done.stderr


def test_error_message_form(tmp_path: Path) -> None:
    error = sender_error(tmp_path, "hosts: [a]\nask_timeout: -1\n")
    assert str(error) == (
        f"{tmp_path / '.rqprc'}: key 'ask_timeout': bad value '-1': "
        "expected a positive duration in seconds (e.g. 2, 0.5, '500ms', '2s', '5m', '1h', "
        "'1d') (line 2)"
    )


HOST_ERRORS = [
    ("hosts: [a, 'b:0']", "hosts[1]", "'b:0'"),
    ("hosts: ['a:65536']", "hosts[0]", "'a:65536'"),
    ("hosts: ['a:']", "hosts[0]", "'a:'"),
    ("hosts: ['a:x']", "hosts[0]", "'a:x'"),
    ("hosts: ['a b']", "hosts[0]", "'a b'"),
    ("hosts: ['-a']", "hosts[0]", "'-a'"),
    ("hosts: ['a..b']", "hosts[0]", "'a..b'"),
    ("hosts: ['1.2.3.999']", "hosts[0]", "'1.2.3.999'"),
    ("hosts: ['[::1']", "hosts[0]", "'[::1'"),
    ("hosts: ['[::1]x']", "hosts[0]", "'[::1]x'"),
    ("hosts: ['[1.2.3.4]:5']", "hosts[0]", "'[1.2.3.4]:5'"),
    ("hosts: ['1:2:3']", "hosts[0]", "'1:2:3'"),
    ("hosts: ['']", "hosts[0]", "''"),
    ("hosts: [7]", "hosts[0]", "'7'"),
    ("hosts:\n  - 1:2:3:4:5:6:7:8", "hosts[0]", "(quote IPv6 addresses in YAML)"),
]


def test_bad_hosts(tmp_path: Path) -> None:
    for text, key, shown in HOST_ERRORS:
        message = str(sender_error(tmp_path, text + "\n"))
        assert message.startswith(f"{tmp_path / '.rqprc'}: key {key!r}: bad value "), (text, message)
        assert shown in message, (text, message)
        assert "expected 'host', 'host:port'" in message, (text, message)


def test_hosts_must_be_a_non_empty_list(tmp_path: Path) -> None:
    for text, shown in [("hosts: []", "'[]'"), ("hosts: rqp1", "'rqp1'"), ("hosts: {a: 1}", "\"{'a': 1}\"")]:
        message = str(sender_error(tmp_path, text + "\n"))
        expected = f"{tmp_path / '.rqprc'}: key 'hosts': bad value {shown}: expected a non-empty list of hosts"
        assert message.startswith(expected), message


def test_hosts_is_required(tmp_path: Path) -> None:
    for text in ["port: 1\n", "hosts:\n", "hosts: null\n"]:
        error = sender_error(tmp_path, text)
        expected = f"{tmp_path / '.rqprc'}: key 'hosts' is required: expected a non-empty list"
        assert str(error).startswith(expected)
        assert error.key == "hosts"


def test_empty_rqprc(tmp_path: Path) -> None:
    for text in ["", "# only a comment\n", "---\n"]:
        error = sender_error(tmp_path, text)
        assert str(error).startswith(f"{tmp_path / '.rqprc'}: the file is empty; key 'hosts' is required")


def test_duplicate_hosts(tmp_path: Path) -> None:
    cases = [("hosts: [a, b, A]", "hosts[2]", "hosts[0]"), ("hosts: ['a:7460', a]", "hosts[1]", "hosts[0]"),
             ("hosts: ['[::1]', '[0::1]:7460']", "hosts[1]", "hosts[0]"),
             ("port: 1\nhosts: [c, b, 'b:1']", "hosts[2]", "hosts[1]")]
    for text, key, first in cases:
        message = str(sender_error(tmp_path, text + "\n"))
        assert f"key {key!r}: bad value" in message, message
        assert "expected each host once, but" in message and f"is {first} too" in message, message


def test_same_host_on_other_ports_is_fine(tmp_path: Path) -> None:
    assert len(load_sender(tmp_path, "hosts: [a, 'a:1', '[::1]', '[::1]:1']\n").hosts) == 4


def test_ipv6_hosts_in_a_file(tmp_path: Path) -> None:
    cfg = load_sender(tmp_path, "hosts:\n  - '[2001:DB8::1]:7461'\n  - fe80::1\n  - '[::1]'\n")
    assert cfg.hosts == (
        HostAddress("2001:db8::1", 7461), HostAddress("fe80::1", 7460), HostAddress("::1", 7460)
    )


def test_negative_key_t_is_normalised(tmp_path: Path) -> None:
    text = "hosts: [a]\ntransmission_queue: -1\ndead_letter_queue: -2147483648\nqueues: {A: '-0x2'}\n"
    cfg = load_sender(tmp_path, text)
    assert (cfg.transmission_queue, cfg.dead_letter_queue) == (0xFFFFFFFF, 0x80000000)
    assert cfg.queues["A"] == 0xFFFFFFFE


def test_typo_suggests_the_key(tmp_path: Path) -> None:
    error = sender_error(tmp_path, "hosts: [a]\nask_timout: 2\n")
    message = str(error)
    assert message.startswith(
        f"{tmp_path / '.rqprc'}: unknown key 'ask_timout' (did you mean 'ask_timeout'?); known keys: hosts, port,"
    )
    assert message.endswith("(line 2)")
    assert error.key == "ask_timout"


def test_unknown_key_without_a_near_one(tmp_path: Path) -> None:
    message = str(sender_error(tmp_path, "hosts: [a]\nzzz: 2\n"))
    assert "unknown key 'zzz'; known keys: " in message


def test_receiver_key_in_rqprc_is_pointed_out(tmp_path: Path) -> None:
    message = str(sender_error(tmp_path, "hosts: [a]\nput_retry_count: 2\n"))
    assert "unknown key 'put_retry_count' (it belongs in a receiver config" in message
    assert "(it belongs in the sender's .rqprc" in str(receiver_error(tmp_path, "hosts: [a]\n"))
    for key, value in (("stall_after", "5s"), ("heartbeat_interval", "3s")):  # (a trial: these
        message = str(receiver_error(tmp_path, f"{key}: {value}\n"))  # got "did you mean
        assert f"unknown key '{key}' (it belongs in the sender's .rqprc)" in message  # state_dir"


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    message = str(sender_error(tmp_path, "hosts:\n  - a\nport: 7460\n  window: 3\n"))
    assert message.startswith(f"{tmp_path / '.rqprc'}: line 4, column 9: invalid YAML: "), message


def test_unquoted_ipv6_gets_a_hint(tmp_path: Path) -> None:
    message = str(sender_error(tmp_path, "hosts:\n  - [::1]:7460\n"))
    assert message.startswith(f"{tmp_path / '.rqprc'}: line 2, column 6: invalid YAML: ")
    assert message.endswith("quote IPv6 addresses in brackets: '[::1]:7460'")


def test_yaml_unclosed_bracket(tmp_path: Path) -> None:
    message = str(sender_error(tmp_path, "hosts: [a\nport: 1\n"))
    assert "invalid YAML" in message and "line " in message


def test_yaml_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    """A re-check: 1,000 nested lists raised RecursionError (a traceback from --check)."""
    message = str(sender_error(tmp_path, "hosts: " + "[" * 1000 + "1" + "]" * 1000 + "\n"))
    assert message.endswith(".rqprc: nested too deeply to be a config file"), message
    # rqpctl status, which reads a file with a mistake once more to find its agent, too
    out = subprocess.run([sys.executable, "-m", "rqp.tools.ctl", "status", "--agent", "sender",
                          "--rqprc", str(tmp_path / ".rqprc")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr and \
        out.stderr.strip().endswith("nested too deeply to be a config file"), out.stderr


def test_python_tags_are_refused(tmp_path: Path) -> None:
    message = str(sender_error(tmp_path, "hosts: !!python/object/apply:os.system ['true']\n"))
    assert "line 1" in message and "invalid YAML" in message


def test_duplicate_yaml_keys_are_an_error(tmp_path: Path) -> None:
    error = sender_error(tmp_path, "hosts: [a]\nport: 1\nport: 2\n")
    assert str(error) == f"{tmp_path / '.rqprc'}: key 'port' appears twice, at lines 2 and 3"
    error = receiver_error(tmp_path, "offer:\n  deny: [1]\n  deny: [2]\n")
    assert error.key == "offer.deny"


def test_aliases_and_recursion_do_not_hang(tmp_path: Path) -> None:
    cfg = load_sender(tmp_path, "hosts: &h [a]\nqueues: &q {A: 1}\n")
    assert cfg.hosts == (HostAddress("a", 7460),)
    assert "unknown key 'x'" in str(sender_error(tmp_path, "hosts: [a]\nx: &r [*r]\n"))


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    for text in ["- a\n- b\n", "just a string\n", "42\n"]:
        for error in (sender_error(tmp_path, text), receiver_error(tmp_path, text)):
            assert "expected a mapping of keys to values at the top level" in str(error)
            assert error.key is None


def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / ".rqprc"
    path.write_bytes(b"hosts: [\xff]\n")
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_sender_config(path, env={})


def test_line_numbers_for_nested_keys(tmp_path: Path) -> None:
    message = str(sender_error(tmp_path, "hosts:\n  - a\n  - 'b:0'\n"))
    assert "key 'hosts[1]'" in message and message.endswith("(line 3)")


RECEIVER_ERRORS = [
    ("listen: ':0'", "listen", "':0'", "expected 'host:port', 'host' or ':port'"),
    ("listen: 'a b:1'", "listen", "'a b:1'", "':7460'"),
    ("listen: 7460", "listen", "'7460'", "expected 'host:port'"),
    ("dead_letter_queue: 0", "dead_letter_queue", "'0'", "IPC_PRIVATE"),
    ("dead_letter_queue: 0x99\nqueues: {A: 0x99}", "queues.A", "'0x00000099'",
     "0x00000099 is this agent's dead_letter_queue (DEAD.LETTER.Q)"),
    ("max_message_size: 0", "max_message_size", "'0'", "expected a positive number of bytes"),
    ("max_message_size: 2GiB", "max_message_size", "'2GiB'", f"up to {HARD_MESSAGE_CAP}"),
    ("max_message_size: 8KB", "max_message_size", "'8KB'", "'8KiB'"),
    ("max_message_size: -1", "max_message_size", "'-1'", "positive number of bytes"),
    ("offer: {allow: [NOPE]}", "offer.allow[0]", "'NOPE'",
     "expected a queue key or a queue name defined under 'queues'"),
    ("queues: {A: 1}\noffer: {allow: [1, A, NOPE]}", "offer.allow[2]", "'NOPE'",
     "known names: A, DEAD.LETTER.Q"),
    ("queues: {PROD_A: 1}\noffer: {deny: [PROD_B]}", "offer.deny[0]", "'PROD_B'", "(did you mean 'PROD_A'?)"),
    ("offer: {allow: [RQP.XMIT.Q]}", "offer.allow[0]", "'RQP.XMIT.Q'", "known names: DEAD.LETTER.Q"),
    ("offer: {allow: [0]}", "offer.allow[0]", "'0'", "IPC_PRIVATE"),
    ("offer: {deny: 5}", "offer.deny", "'5'", "expected a list of queue keys, configured"),
    ("offer: {allow: null}", "offer.allow", "'null'", "expected a list of queue keys, "
                                                       "configured"),
    ("offer: [1]", "offer", "'[1]'", "expected a mapping with 'allow' and/or 'deny'"),
    ("queues: {DEAD.LETTER.Q: 1}", "queues.DEAD.LETTER.Q", "'DEAD.LETTER.Q'", "cannot be redefined"),
    ("put_retry_count: -1", "put_retry_count", "'-1'", "an integer >= 0"),
    ("put_retry_interval: 0", "put_retry_interval", "'0'", "expected a positive duration"),
    ("put_retry_interval: no", "put_retry_interval", "'false'", "booleans"),
    ("host_name: 'a b'", "host_name", "'a b'", "expected a host name"),
    ("state_dir: [x]", "state_dir", "\"['x']\"", STATE_DIR_EXPECTED),
]


def test_receiver_errors(tmp_path: Path) -> None:
    path = str(tmp_path / "receiver.yaml")
    for text, key, shown, expected in RECEIVER_ERRORS:
        error = receiver_error(tmp_path, text + "\n")
        message = str(error)
        assert message.startswith(f"{path}: key {key!r}: bad value {shown}: "), (text, message)
        assert expected in message, (text, message)
        assert (error.path, error.key) == (path, key), text


def test_offer_typo(tmp_path: Path) -> None:
    error = receiver_error(tmp_path, "offer:\n  alow: [1]\n")
    assert str(error).startswith(
        f"{tmp_path / 'receiver.yaml'}: unknown key 'offer.alow' (did you mean 'allow'?); known keys: allow, deny"
    )
    assert error.key == "offer.alow"


def test_mapping_errors_say_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        sender_config_from_mapping({"hosts": ["a"], "window": 0})
    assert str(info.value).startswith("<mapping>: key 'window': bad value '0'")
    assert info.value.path is None
    with pytest.raises(ConfigError, match="^cfg.yaml: key 'listen'"):
        receiver_config_from_mapping({"listen": 5}, source="cfg.yaml")


# --------------------------------------------------------------------------------------------
# The value parsers


def rejects(parser: Callable[[object], object], values: list[object]) -> None:
    for value in values:
        with pytest.raises(ConfigError, match="^bad value .*: expected") as info:
            parser(value)
        assert isinstance(info.value, ValueError), value  # so argparse reports it


def test_parse_duration() -> None:
    cases = [(2, 2.0), (0.5, 0.5), ("2", 2.0), ("1.5s", 1.5), ("500ms", 0.5), ("250 ms", 0.25),
             ("3m", 180.0), ("1h", 3600.0), ("1d", 86400.0), ("2w", 1209600.0), (".5s", 0.5),
             (" 2s ", 2.0),
             ("0.001ms", 1e-6)]
    for value, seconds in cases:
        assert parse_duration(value) == seconds, value
    rejects(parse_duration, [True, False, None, 0, -1, 0.0, float("nan"), float("inf"), "", "s", "2 s s",
                             "2y", "-1s", "2S", "1e3", "1_000", 10**400, "9" * 5000, [2]])


def test_parse_queue_key() -> None:
    cases = [(1, 1), (0x52510001, 0x52510001), ("0x52510001", 0x52510001), ("0X52510001", 0x52510001),
             ("1381040129", 0x52510001), ("017", 15), ("0o17", 15), ("-1", 0xFFFFFFFF), (-1, 0xFFFFFFFF),
             (-(2**31), 0x80000000), (2**32 - 1, 0xFFFFFFFF), (" 42 ", 42), ("+42", 42)]
    for value, key in cases:
        assert parse_queue_key(value) == key, value
    rejects(parse_queue_key, [0, "0", "000", "0x0", 2**32, -(2**31) - 1, "0x100000000", "08", "0x", "1.0",
                              1.0, True, None, "", "a b", [1], "9" * 5000])


def test_parse_queue_key_names() -> None:
    names = {"PROD_THE_SCHED_COMMON": 5, "x.y-z": 6}
    assert parse_queue_key("PROD_THE_SCHED_COMMON", names) == 5
    assert parse_queue_key("x.y-z", names) == 6
    assert parse_queue_key("7", names) == 7
    with pytest.raises(ConfigError, match="did you mean 'PROD_THE_SCHED_COMMON'"):
        parse_queue_key("PROD_THE_SCHED_COMON", names)
    with pytest.raises(ConfigError, match="a queue name cannot be used here"):
        parse_queue_key("PROD_THE_SCHED_COMMON")


def test_parse_host() -> None:
    cases = [("rqp1", "rqp1", 7460), ("RQP1.Example.ORG:1", "rqp1.example.org", 1),
             ("1.2.3.4:5", "1.2.3.4", 5), ("[::1]:7461", "::1", 7461), ("[::1]", "::1", 7460),
             ("::1", "::1", 7460), ("[0:0::1]:80", "::1", 80),
             ("fe80::1%eth0", "fe80::1%eth0", 7460), ("host_1.lan.", "host_1.lan.", 7460), (" a:2 ", "a", 2)]
    for value, host, port in cases:
        address = parse_host(value, 7460)
        assert address == HostAddress(host, port), value
        h, p = address  # unpacks like the (host, port) pair it is
        assert (h, p) == (host, port)
    rejects(parse_host, ["", "a b", "a:0", "a:65536", "a:", ":1", "[::1", "[x]", "1.2.3.4.5", "a" * 300,
                         None, 1])


def test_host_address_str() -> None:
    assert str(HostAddress("a", 1)) == "a:1"
    assert str(HostAddress("::1", 7460)) == "[::1]:7460"


def test_parse_size() -> None:
    cases = [(1, 1), ("8192", 8192), ("8KiB", 8192), ("64 KiB", 65536), ("1MiB", 1 << 20),
             ("1mib", 1 << 20), ("100B", 100), (HARD_MESSAGE_CAP, HARD_MESSAGE_CAP)]
    for value, size in cases:
        assert parse_size(value) == size, value
    rejects(parse_size, [0, -1, True, 1.5, "1.5KiB", "8KB", "8k", HARD_MESSAGE_CAP + 1, "2GiB", "9" * 30])


def test_spill_limit_takes_sizes_beyond_a_messages() -> None:
    """A trial: 'spill_limit: 4GiB' was refused with max_message_size's text (up to
    2147483647, or null for msgmax)."""
    from rqp.config import MAX_SPILL_LIMIT, _parse_spill_limit
    assert _parse_spill_limit("4GiB") == 4 << 30 and _parse_spill_limit("1TiB") == 1 << 40
    assert _parse_spill_limit("1PiB") == MAX_SPILL_LIMIT
    rejects(_parse_spill_limit, [0, -1, True, "1.5GiB", MAX_SPILL_LIMIT + 1, "9" * 30])
    with pytest.raises(ConfigError, match=r"at most 1125899906842624 \(1 PiB\)"):
        _parse_spill_limit("2PiB")
    with pytest.raises(ConfigError) as info:
        _parse_spill_limit(-1)
    assert "msgmax" not in str(info.value) and "'4GiB'" in str(info.value)


# --------------------------------------------------------------------------------------------
# Properties

_LABEL = r"[a-z](?:[a-z0-9-]{0,14}[a-z0-9])?"
HOSTNAMES = st.from_regex(rf"{_LABEL}(?:\.{_LABEL}){{0,3}}", fullmatch=True)
HOSTS = st.one_of(HOSTNAMES, st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str))
PORTS = st.integers(1, 65535)


@settings(max_examples=60)
@given(HOSTS, PORTS, PORTS)
def test_parse_host_round_trips(host: str, port: int, default_port: int) -> None:
    address = HostAddress(host, port)
    assert parse_host(str(address), default_port) == address


@settings(max_examples=40)
@given(HOSTS.map(str.upper), PORTS)
def test_parse_host_is_idempotent(host: str, port: int) -> None:
    address = parse_host(str(parse_host(host, port)), 1)
    assert address == parse_host(host, port)
    assert parse_host(str(address), 1) == address


@given(st.integers(1, int(MAX_DURATION * 1000)))
def test_milliseconds(n: int) -> None:
    assert parse_duration(f"{n}ms") == n / 1000
    assert parse_duration(f"{n} ms") == n / 1000


@given(st.integers(1, int(MAX_DURATION)))
def test_seconds(n: int) -> None:
    assert parse_duration(f"{n}s") == parse_duration(n) == parse_duration(str(n)) == n


@given(st.integers(-(2**31), 2**32 - 1).filter(bool))
def test_queue_keys_in_any_base(key: int) -> None:
    expected = key & 0xFFFFFFFF
    sign = "-" if key < 0 else ""
    assert parse_queue_key(key) == expected
    assert parse_queue_key(str(key)) == expected
    assert parse_queue_key(f"{sign}{abs(key):#x}") == expected
    assert parse_queue_key(f"{sign}0{abs(key):o}") == expected


# --------------------------------------------------------------------------------------------
# One defaults table (rqp.protocol.constants): config, the sender core's Settings, the README
# and the example files agree.


def _differing(loaded, default) -> set[str]:
    return {f.name for f in dataclasses.fields(default)
            if getattr(loaded, f.name) != getattr(default, f.name)}


def test_the_example_files_show_the_defaults():
    """config/*.example.yaml say "the values shown here are the defaults unless the comment
    says otherwise": only these keys are set to something else, as examples."""
    root = Path(__file__).resolve().parent.parent / "config"
    sender = config.load_sender_config(root / "rqprc.example.yaml")
    assert _differing(sender, config.SenderConfig(hosts=())) - {"state_dir"} == {
        "hosts", "queues", "retry_max_attempts", "retry_max_age", "control_socket",
        "metrics_listen", "tls", "host_tls", "source"}
    receiver = config.load_receiver_config(root / "receiver.example.yaml")
    assert _differing(receiver, config.ReceiverConfig()) - {"state_dir"} == {
        "listen", "max_message_size", "queues", "offer_allow", "offer_deny", "host_name",
        "control_socket", "metrics_listen", "tls", "peers", "source"}


def test_the_sender_core_settings_default_to_the_config_defaults():
    from rqp.protocol.sender import Settings

    assert Settings(hosts=()) == Settings.from_config(config.SenderConfig(hosts=()))


def test_the_readme_tables_show_the_defaults():
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    defaults = {**{f.name: getattr(config.ReceiverConfig(), f.name)
                   for f in dataclasses.fields(config.ReceiverConfig)},
                **{f.name: getattr(config.SenderConfig(hosts=()), f.name)
                   for f in dataclasses.fields(config.SenderConfig)}}
    checked = set()
    for keys, shown in re.findall(r"^\| ((?:`\w+`(?:, )?)+) \| ([^|]+) \|", readme, re.M):
        names = re.findall(r"`(\w+)`", keys)
        values = [v.strip() for v in shown.split(", ")] if len(names) > 1 else [shown.strip()]
        for name, value in zip(names, values):
            value = value.split(" (")[0].replace(",", "").strip("`")
            if name in ("ask_timeout", "confirm_timeout", "connect_timeout",
                        "retry_backoff_initial", "retry_backoff_max", "put_retry_interval",
                        "dedup_window_age", "first_frame_timeout", "idle_timeout"):
                parsed = config.parse_duration(value.replace(" ", ""))
            elif name in ("transmission_queue", "dead_letter_queue"):
                parsed = config.parse_queue_key(value)
            elif name in ("port", "window", "error_limit", "put_retry_count",
                          "dedup_window_keys", "max_connections", "max_connections_per_source"):
                parsed = int(value)
            elif name == "listen":
                parsed = config.parse_host(value)
            else:
                continue
            assert parsed == defaults[name], (name, value)
            checked.add(name)
    assert checked == {"port", "transmission_queue", "dead_letter_queue", "ask_timeout",
                       "confirm_timeout", "connect_timeout", "error_limit",
                       "retry_backoff_initial", "retry_backoff_max", "window", "listen",
                       "put_retry_count", "put_retry_interval", "dedup_window_keys",
                       "dedup_window_age", "max_connections", "max_connections_per_source",
                       "first_frame_timeout", "idle_timeout"}


@pytest.mark.parametrize("key", ["idle_timeout", "first_frame_timeout", "handshake_timeout"])
def test_connection_timeouts_have_a_floor(tmp_path: Path, key) -> None:
    """A trial: idle_timeout 1ms (meant as 1m?) was taken, and every sending MCA reconnected
    between its frames (12,288 sends for 10,000 messages)."""
    message = str(receiver_error(tmp_path, f"{key}: 1ms\n"))
    assert f"key '{key}': bad value '1ms': expected a duration of at least 0.1 s" in message
    assert "1m is a minute, 1ms a millisecond" in message
    assert getattr(load_receiver(tmp_path, f"{key}: 100ms\n"), key) == 0.1


@pytest.mark.parametrize("key, value", [("stall_after", "500ms"), ("heartbeat_interval", "1ms")])
def test_stall_after_and_heartbeat_interval_have_a_floor(tmp_path: Path, key, value) -> None:
    """A trial: heartbeat_interval 1ms sent 1,244 heartbeats in 1.5 s; stall_after 1ms calls
    every route stalled between two answers. Both must be at least a second."""
    message = str(sender_error(tmp_path, f"hosts: [rqp1]\n{key}: {value}\n"))
    assert f"key '{key}': bad value '{value}': expected a duration of at least 1 s" in message
    assert load_sender(tmp_path, f"hosts: [rqp1]\n{key}: 1s\n").__getattribute__(key) == 1.0


def test_the_archive_tools_say_a_rqprc_they_cannot_reach_and_do_not_pass_it_over(monkeypatch):
    """A re-check: load_optional_rqprc took any error of find_rqprc for 'no .rqprc', so a
    drain whose ./.rqprc could not be searched, with /etc/rqp/rqprc behind it, drained the
    default queue, not that file's, without a word. Only 'none found' is none."""
    def unreachable(*args, **kwargs):
        raise config.ConfigError("./.rqprc: cannot read the file: Permission denied "
                                 "(the .rqprc looked at before /etc/rqp/rqprc)")
    monkeypatch.delenv("RQPRC", raising=False)
    monkeypatch.setattr(config, "find_rqprc", unreachable)
    with pytest.raises(config.ConfigError, match="looked at before /etc/rqp/rqprc"):
        config.load_optional_rqprc()

    def none(*args, **kwargs):
        raise config.NoRqprcFound("no .rqprc found; looked at: ...")
    monkeypatch.setattr(config, "find_rqprc", none)
    assert config.load_optional_rqprc() is None


@pytest.mark.parametrize("example", sorted(
    (Path(__file__).resolve().parent.parent / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_the_fast_yaml_loader_reads_what_the_python_one_reads(example):
    """read_yaml parses with libyaml where PyYAML has it (a trial's .rqprc of 1,000 queue
    names took 93 ms to read at every openConnection, 7 ms so): the data and every key's line
    are the Python loader's, for every shipped example and a .rqprc of many names."""
    from rqp.config import _FAST_LOADER, _compose_and_construct, _node_lines
    assert _FAST_LOADER is yaml.CSafeLoader  # (libyaml is in the wheel on this platform)
    many = "queues:\n" + "".join(f"  Q_{i}: {0x6B000000 + i:#x}\n" for i in range(1000)) + \
        "hosts: [a, 'b:7461', {host: c, tls: false}]\nwindow: 0o17\non: yes\nwhen: 1:30\n"
    for text in (example.read_text(), many):
        fast_node, fast = _compose_and_construct(text, yaml.CSafeLoader)
        node, slow = _compose_and_construct(text, yaml.SafeLoader)
        assert fast == slow
        assert _node_lines(fast_node, "f") == _node_lines(node, "f")
