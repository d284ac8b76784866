"""RQP over TLS (spec section 7): the agents' TLS contexts, checked files, peer identities.

TLS from the first byte, 1.2 at least, ALPN ``rqp/1``, mutual authentication: the receiver
requires a client certificate signed by its CA, the sender checks the receiver's certificate
against the host name it dialled. :func:`check_files` reads the three files of a ``tls:``
block before any context is built, so that a problem is named at start-up (which file, what
is wrong) instead of as an OpenSSL error code at the first connection. The blocks themselves
are :class:`rqp.config.TLSFiles`.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import os
import ssl
import stat
from pathlib import Path

from rqp.protocol.errors import RQPError

__all__ = ["ALPN", "TLSFileError", "check_files", "server_context",
           "client_context", "peer_names", "handshake_problem", "EXPIRY_WARNING",
           "READ_BUFFER", "bound_read_buffers", "file_digests", "CLOSED_IN_HANDSHAKE",
           "ERRNO_OF"]

ALPN = "rqp/1"
#: A certificate this close to its end is warned about at start-up and on reload.
EXPIRY_WARNING = datetime.timedelta(days=14)
#: Bytes asyncio's TLS layer reads into at once, per connection (four full TLS records). Its
#: own 256 KiB is allocated, and zeroed, for every connection as its handshake starts: a
#: trial's 512 connections that never finished one took a receiving MCA from 47 to 354 MB
#: (64 KiB: 161 MB). Messages are at most msgmax; answers are 2 bytes.
READ_BUFFER = 64 * 1024


class TLSFileError(RQPError):
    """A ``tls:`` file cannot be used: the message names the file and what is wrong."""


def _group_members(gid: int) -> list[str]:
    """The users of group ``gid`` (listed in it, or with it as their primary group) other
    than this process's user."""
    import grp
    import pwd

    me = os.geteuid()
    try:
        listed = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return []
    names = listed | {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid}
    own = {p.pw_name for p in pwd.getpwall() if p.pw_uid == me}
    return sorted(names - own)


def _read(files, field: str) -> bytes:
    path = getattr(files, field)
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TLSFileError(f"{files.name(field)}: no such file") from None
    except IsADirectoryError:
        raise TLSFileError(f"{files.name(field)}: is a directory, expected a PEM file") from None
    except OSError as exc:
        raise TLSFileError(f"{files.name(field)}: cannot read it: {exc.strerror} "
                           f"(euid {os.geteuid()})") from None


def _certificates(files, field: str, what: str):
    from cryptography import x509

    data = _read(files, field)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise TLSFileError(f"{files.name(field)}: holds no PEM certificate (expected {what}, "
                           f"'-----BEGIN CERTIFICATE-----')")
    return certs


def _when(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def check_files(files, now: datetime.datetime | None = None) -> list[str]:
    """Check the ``tls:`` files; raise :class:`TLSFileError` naming the first problem that
    stops TLS from working, return warnings (expiring soon, key readable by others, own
    certificate not from the configured CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.exceptions import InvalidSignature

    now = now or datetime.datetime.now(datetime.timezone.utc)
    warnings: list[str] = []
    chain = _certificates(files, "cert", "this host's certificate")
    cert = chain[0]
    if cert.not_valid_after_utc < now:
        raise TLSFileError(f"{files.name('cert')}: the certificate expired on "
                           f"{_when(cert.not_valid_after_utc)}; issue a new one "
                           f"(rqpctl tls issue)")
    if cert.not_valid_before_utc > now:
        raise TLSFileError(f"{files.name('cert')}: the certificate is not valid before "
                           f"{_when(cert.not_valid_before_utc)} (is this host's clock right?)")
    if cert.not_valid_after_utc - now < EXPIRY_WARNING:
        warnings.append(f"{files.name('cert')}: the certificate expires on "
                        f"{_when(cert.not_valid_after_utc)}")

    key_data = _read(files, "key")
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except TypeError:
        raise TLSFileError(f"{files.name('key')}: the key is encrypted with a passphrase; the "
                           f"agent needs an unencrypted key (readable by its user only)") from None
    except (ValueError, Exception) as exc:  # noqa: BLE001 - cryptography's parse errors vary
        raise TLSFileError(f"{files.name('key')}: holds no usable PEM private key "
                           f"('-----BEGIN PRIVATE KEY-----'): {exc}") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if (key.public_key().public_bytes(serialization.Encoding.DER, public)
            != cert.public_key().public_bytes(serialization.Encoding.DER, public)):
        raise TLSFileError(f"{files.name('key')}: the key does not match the certificate "
                           f"{files.cert} (they are from different pairs)")
    info = os.stat(files.key)
    mode = info.st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO) & ~stat.S_IRGRP:
        warnings.append(f"{files.name('key')}: other users may read or write the private key "
                        f"(mode {stat.S_IMODE(mode):03o}); chmod 600 it (owned by the "
                        "agent's user)")
    elif mode & stat.S_IRGRP and (others := _group_members(info.st_gid)):
        # (a trial: 0640 root:rqp, and the applications are in rqp, as the README asks)
        warnings.append(f"{files.name('key')}: its group may read the private key (mode "
                        f"{stat.S_IMODE(mode):03o}), and the group has other members than "
                        f"this agent's user ({', '.join(others[:5])}"
                        f"{', ...' if len(others) > 5 else ''}): chown the key to the agent's "
                        "user and chmod 600 it")

    authorities = _certificates(files, "ca", "the CA certificate(s) peers are signed by")
    for ca in authorities:
        try:
            constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
            is_ca = constraints.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise TLSFileError(f"{files.name('ca')}: '{ca.subject.rfc4514_string()}' is not a "
                               f"CA certificate (no basicConstraints CA:TRUE); give the CA's "
                               f"certificate, not a host's")
        if ca.not_valid_after_utc < now:
            raise TLSFileError(f"{files.name('ca')}: the CA certificate "
                               f"'{ca.subject.rfc4514_string()}' expired on "
                               f"{_when(ca.not_valid_after_utc)}")
    signed = False
    for ca in authorities:
        try:
            cert.verify_directly_issued_by(ca)
            signed = True
            break
        except (ValueError, TypeError, InvalidSignature):
            continue
    if not signed:
        warnings.append(f"{files.name('cert')} is not signed by a CA in {files.ca}: peers that "
                        f"trust only that CA will refuse this host")
    return warnings


def file_digests(blocks) -> dict[str, str]:
    """The SHA-256 of every file of the ``tls:`` blocks (None ones skipped), by path: a
    rotation replaces files and changes no setting, so a reload compares these to say so (a
    trial's reload after one said "nothing changed")."""
    digests = {}
    for files in blocks:
        for path in () if files is None else (files.cert, files.key, files.ca):
            try:
                digests[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            except OSError:
                digests[path] = ""  # (checked, and named, where it is loaded)
    return digests


def _context(files, purpose: ssl.Purpose) -> ssl.SSLContext:
    side = ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH \
        else ssl.PROTOCOL_TLS_CLIENT
    context = ssl.SSLContext(side)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols([ALPN])
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(files.cert, files.key)
    except ssl.SSLError as exc:
        raise TLSFileError(f"{files.name('cert')} with {files.name('key')}: OpenSSL cannot "
                           f"use them: {exc.reason or exc}") from None
    try:
        context.load_verify_locations(cafile=files.ca)
    except ssl.SSLError as exc:
        raise TLSFileError(f"{files.name('ca')}: OpenSSL cannot use it: "
                           f"{exc.reason or exc}") from None
    return context


def bound_read_buffers(size: int = READ_BUFFER) -> None:
    """Make the TLS connections of this process read into ``size`` bytes at most: asyncio's
    ``SSLProtocol.max_size``, which has no public setting (where it is gone, nothing to do)."""
    import asyncio.sslproto

    protocol = getattr(asyncio.sslproto, "SSLProtocol", None)
    if protocol is not None and getattr(protocol, "max_size", 0) > size:
        protocol.max_size = size


def server_context(files) -> ssl.SSLContext:
    """The receiving MCA's context: a client certificate from ``files.ca`` is required."""
    return _context(files, ssl.Purpose.CLIENT_AUTH)


def client_context(files) -> ssl.SSLContext:
    """The sending MCA's context: the receiver's certificate must be from ``files.ca`` and
    name the host dialled (``check_hostname``)."""
    context = _context(files, ssl.Purpose.SERVER_AUTH)
    context.check_hostname = True
    return context


def peer_names(ssl_object) -> tuple[str, ...]:
    """A verified peer's identity: its certificate's DNS subject-alternative names, else its
    common name (spec section 7); empty when there is no certificate."""
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    if not cert:
        return ()
    names = tuple(value for kind, value in cert.get("subjectAltName", ()) if kind == "DNS")
    if names:
        return names
    return tuple(value for rdn in cert.get("subject", ()) for key, value in rdn
                 if key == "commonName")[:1]


#: What a connection the receiver closed during a handshake this host began most likely means
#: (its log says which: a plaintext one names a TLS handshake it was sent).
CLOSED_IN_HANDSHAKE = (" (the receiver closed the connection during the handshake: no TLS on "
                       "that port, or at its max_connections or max_connections_per_source?)")


def handshake_problem(exc: BaseException) -> str:
    """A failed handshake in words an operator can act on (the OpenSSL reason, plus what the
    certificate check said)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = ""
        if "mismatch" in (exc.verify_message or ""):
            hint = (" (the receiver's certificate does not name the host as this sender dials "
                    "it: list that name or address in hosts, or issue the receiver a "
                    "certificate with it: rqpctl tls issue HOST --dns NAME --ip ADDRESS)")
        elif any(word in (exc.verify_message or "") for word in ("issuer", "self-signed")):
            # (another CA's chain, its root sent along: "self-signed certificate in
            # certificate chain", which a trial's sender said with no hint)
            hint = " (the peer's certificate is not from the CA in this host's tls.ca)"
        return f"certificate verify failed: {exc.verify_message}{hint}"
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or str(exc)).lower().replace("_", " ")
        hints = {
            "wrong version number": " (the peer does not speak TLS: plaintext RQP on a TLS port?)",
            "http request": " (the peer does not speak TLS)",
            "peer did not return a certificate": " (the peer sent no client certificate)",
            "certificate required": " (this host sent no certificate the peer accepts)",
            "unknown ca": " (the peer does not trust the CA of this host's certificate)",
            "certificate expired": " (the peer says this host's certificate has expired)",
            "no application protocol": " (the peer does not offer ALPN rqp/1)",
            "eof occurred in violation of protocol": CLOSED_IN_HANDSHAKE,
            "unexpected eof while reading": CLOSED_IN_HANDSHAKE,
        }
        hint = next((h for k, h in hints.items() if k in reason), "")
        return f"TLS handshake failed: {reason}{hint}"
    if isinstance(exc, (TimeoutError, ConnectionError, OSError)):
        code = exc.errno or ERRNO_OF.get(type(exc))  # (asyncio's TLS raises them bare)
        return "TLS handshake failed: " + (os.strerror(code) if code else (
            exc.__class__.__name__ + (f": {exc}" if str(exc) else "")))
    return f"TLS handshake failed: {exc}"


#: The errno that each of these means when raised without one.
ERRNO_OF = {ConnectionResetError: errno.ECONNRESET, BrokenPipeError: errno.EPIPE,
            ConnectionAbortedError: errno.ECONNABORTED,
            ConnectionRefusedError: errno.ECONNREFUSED}
