"""Certificates for real users (rqpctl tls) and the start-up check of a tls: block
(rqp.system.tls.check_files): every problem names the file and what is wrong."""

from __future__ import annotations

import datetime
import os
import ssl
import subprocess
import sys

import pytest

from rqp.config import TLSFiles
from rqp.system.tls import TLSFileError, check_files, client_context, server_context
from rqp.tools import tls as tool


@pytest.fixture
def ca(tmp_path):
    tool.init_ca(tmp_path / "ca")
    return tmp_path / "ca"


def files(ca_dir, host: str = "h.test", **changes) -> TLSFiles:
    crt, key = ca_dir / f"{host}.crt", ca_dir / f"{host}.key"
    if not crt.exists():
        tool.issue(host, ca_dir)
    values = {"cert": str(crt), "key": str(key), "ca": str(ca_dir / "ca.crt"), **changes}
    return TLSFiles(**values, where="receiver.yaml: tls")


def test_the_tool_makes_files_that_work_together(ca):
    good = files(ca)
    assert check_files(good) == []
    assert oct(os.stat(good.key).st_mode & 0o777) == "0o600"
    assert server_context(good).verify_mode == ssl.CERT_REQUIRED
    assert client_context(good).check_hostname
    shown = tool.show(ca / "h.test.crt")
    assert "h.test" in shown and "RQP CA" in shown and "days left)" in shown
    with pytest.raises(Exception, match="nope.crt: cannot read it: No such file"):
        tool.show(ca / "nope.crt")


def test_the_tool_refuses_to_overwrite(ca):
    tool.issue("h.test", ca)
    with pytest.raises(Exception, match="exists"):
        tool.issue("h.test", ca)


@pytest.mark.parametrize("problem, expected", [
    ("missing cert", "tls.cert {cert}: no such file"),
    ("cert is a key", "tls.cert {cert}: holds no PEM certificate"),
    ("expired", "the certificate expired on"),
    ("not yet valid", "is not valid before"),
    ("key of another pair", "tls.key {key}: the key does not match the certificate"),
    ("host cert as CA", "is not a CA certificate"),
    ("encrypted key", "encrypted with a passphrase"),
    ("missing ca", "tls.ca {ca}: no such file"),
])
def test_each_problem_is_named_with_its_file(ca, tmp_path, problem, expected):
    good = files(ca)
    f = good
    now = datetime.datetime.now(datetime.timezone.utc)
    if problem == "missing cert":
        f = files(ca, cert=str(tmp_path / "nope.crt"))
    elif problem == "cert is a key":
        f = files(ca, cert=good.key)
    elif problem == "expired":
        tool.issue("old.test", ca, days=1, start=now - datetime.timedelta(days=3))
        f = files(ca, "old.test")
    elif problem == "not yet valid":
        tool.issue("new.test", ca, start=now + datetime.timedelta(days=3))
        f = files(ca, "new.test")
    elif problem == "key of another pair":
        f = files(ca, key=files(ca, "other.test").key)
    elif problem == "host cert as CA":
        f = files(ca, ca=good.cert)
    elif problem == "encrypted key":
        from cryptography.hazmat.primitives import serialization
        key = serialization.load_pem_private_key(open(good.key, "rb").read(), None)
        locked = tmp_path / "locked.key"
        locked.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret")))
        f = files(ca, key=str(locked))
    elif problem == "missing ca":
        f = files(ca, ca=str(tmp_path / "no-ca.crt"))
    with pytest.raises(TLSFileError) as info:
        check_files(f)
    message = str(info.value)
    assert expected.format(cert=f.cert, key=f.key, ca=f.ca) in message, message
    assert message.startswith("receiver.yaml: tls.")


def test_warnings_for_what_works_but_should_not_stay_so(ca, tmp_path):
    other = tmp_path / "other-ca"
    tool.init_ca(other, name="Other CA")
    f = files(ca, ca=str(other / "ca.crt"))  # own certificate not from the CA peers trust
    os.chmod(f.key, 0o644)
    soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=tool.HOST_DAYS - 5)
    warnings = check_files(f, now=soon)
    assert any("expires on" in w for w in warnings), warnings
    assert any("mode 644" in w and "chmod 600" in w for w in warnings), warnings
    assert any("is not signed by a CA in" in w for w in warnings), warnings


def test_rqpctl_tls_from_the_command_line(tmp_path):
    run = [sys.executable, "-m", "rqp.tools.ctl", "tls"]
    out = subprocess.run([*run, "init-ca", str(tmp_path / "ca")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([*run, "issue", "r1.test", "--ca", str(tmp_path / "ca"), "--ip",
                          "10.0.0.1", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "r1.test.crt").exists() and (tmp_path / "r1.test.key").exists()
    # who may read the key, as it is (a trial: "readable by the agents' user only" of root's)
    import pwd
    owner = pwd.getpwuid(os.getuid()).pw_name
    assert f"key {tmp_path}/r1.test.key (mode 600, owner {owner}: on the host, the agents " \
        "(user rqp) must read it: chown rqp there" in out.stdout, out.stdout
    out = subprocess.run([*run, "issue", "r2.test", "--ca", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "make the CA first" in out.stderr, out.stderr


@pytest.mark.parametrize("exc", [
    ConnectionResetError(),  # (asyncio's TLS raises it bare)
    ConnectionResetError(104, "Connection reset by peer"),
    ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:992)"),
], ids=["bare-reset", "reset", "eof"])
def test_a_handshake_the_receiver_cut_off_says_what_may_be_why(exc):
    """A trial: a TLS sender facing a plaintext receiver read "TLS handshake failed:
    ConnectionResetError", where the route said "Connection reset by peer"."""
    from rqp.system.tls import handshake_problem

    if isinstance(exc, ssl.SSLError):
        exc.reason = "UNEXPECTED_EOF_WHILE_READING"  # (what OpenSSL 3 sets)
    said = handshake_problem(exc)
    assert said.startswith("TLS handshake failed: ") and "Error" not in said, said
    assert "(the receiver closed the connection during the handshake: no TLS on that port" \
        in said or isinstance(exc, ConnectionResetError), said


@pytest.mark.parametrize("message", ["unable to get local issuer certificate",
                                     "self-signed certificate in certificate chain",
                                     "self-signed certificate"])
def test_a_certificate_of_another_ca_is_named_so(message):
    """A trial: a receiver whose certificate chained to another CA (its root sent along) was
    'certificate verify failed: self-signed certificate in certificate chain' at the sender,
    with none of the hint the other case had."""
    from rqp.system.tls import handshake_problem

    exc = ssl.SSLCertVerificationError(1, "certificate verify failed")
    exc.verify_message = message
    assert handshake_problem(exc) == (f"certificate verify failed: {message} (the peer's "
                                      "certificate is not from the CA in this host's tls.ca)")


def test_a_key_its_group_may_read_is_said_when_others_are_in_that_group(ca):
    """Trial C: a key 0640 root:rqp drew no warning, and the applications are in rqp (as the
    README asks): every one of them could read the host's private key. Said now, naming
    them; a group of the agent's user alone is fine."""
    import grp
    import pwd

    f = files(ca)
    os.chmod(f.key, 0o640)
    os.chown(f.key, 0, 0)  # root's group: root's alone here (this test runs as root)
    assert [p.pw_name for p in pwd.getpwall() if p.pw_gid == 0 and p.pw_uid != 0] == [] and \
        grp.getgrgid(0).gr_mem in ([], ["root"])
    assert not [w for w in check_files(f) if "private key" in w]
    os.chown(f.key, 0, 65534)  # nogroup: nobody's primary group
    [said] = [w for w in check_files(f) if "private key" in w]
    assert "its group may read the private key (mode 640)" in said and "nobody" in said and \
        "chown the key to the agent's user and chmod 600 it" in said, said
