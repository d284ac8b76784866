"""``rqpctl tls``: a small certificate authority for one RQP deployment.

``rqpctl tls init-ca DIR`` makes ``DIR/ca.crt`` and ``DIR/ca.key`` (the key mode 600).
``rqpctl tls issue HOST --ca DIR [--out DIR] [--ip ADDRESS ...] [--days N]`` makes
``HOST.crt`` and ``HOST.key`` signed by that CA, for both ends of RQP: the receiving MCA serves
it, the sending MCA presents it. Its identity (spec section 7) is the DNS name HOST; a
receiver dialled by address needs that address in the certificate too (``--ip``).
``rqpctl tls show FILE``: what a certificate says (identity, issuer, validity).

Keys are ECDSA P-256: small, and the fastest handshakes OpenSSL offers. The files are PEM, so
``openssl`` or any other CA can make them instead (README, Security).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from rqp.cli import number
from rqp.protocol.access import identity_pattern_problem
from rqp.protocol.errors import RQPError
from rqp.system.service import AGENTS_USER

__all__ = ["init_ca", "issue", "show", "add_commands"]

CA_DAYS = 3650
HOST_DAYS = 397  # what browsers accept at most; rotate with SIGHUP, no restart needed


def _crypto():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, mode: int, force: bool) -> None:
    if path.exists() and not force:
        raise RQPError(f"{path} exists; not replacing it (--force replaces it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key) -> bytes:
    _, _, serialization, *_ = _crypto()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _start(start: datetime.datetime | None) -> datetime.datetime:
    now = datetime.datetime.now(datetime.timezone.utc)
    # An hour back: hosts whose clocks are a little behind still accept it.
    return start or now - datetime.timedelta(hours=1)


def init_ca(directory: Path, *, name: str = "RQP CA", days: int = CA_DAYS,
            force: bool = False) -> tuple[Path, Path]:
    """A self-signed CA certificate and key in ``directory``."""
    x509, hashes, serialization, ec, _, NameOID = _crypto()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = _start(None)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    crt, kf = directory / "ca.crt", directory / "ca.key"
    _write(kf, _key_pem(key), 0o600, force)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
    return crt, kf


def _load_ca(directory: Path):
    x509, _, serialization, *_ = _crypto()
    crt, kf = directory / "ca.crt", directory / "ca.key"
    for path in (crt, kf):
        if not path.is_file():
            raise RQPError(f"{path}: no such file; make the CA first with "
                           f"'rqpctl tls init-ca {directory}'")
    try:
        return (x509.load_pem_x509_certificate(crt.read_bytes()),
                serialization.load_pem_private_key(kf.read_bytes(), password=None))
    except (ValueError, TypeError) as exc:
        raise RQPError(f"{directory}: ca.crt/ca.key are not a PEM certificate and an "
                       f"unencrypted PEM key: {exc}") from None


def issue(host: str, ca_dir: Path, out: Path | None = None, *, ips: tuple[str, ...] = (),
          dns: tuple[str, ...] = (), days: int = HOST_DAYS,
          start: datetime.datetime | None = None, force: bool = False) -> tuple[Path, Path]:
    """``HOST.crt``/``HOST.key`` in ``out`` (default: ``ca_dir``), signed by the CA there."""
    x509, hashes, serialization, ec, EKU, NameOID = _crypto()
    problem = identity_pattern_problem(host)
    if problem or "*" in host or "/" in host:
        raise RQPError(f"host name {host!r}: expected a DNS name (it becomes the "
                       f"certificate's identity and its file name)")
    ca_cert, ca_key = _load_ca(ca_dir)
    names: list = []
    addresses = list(ips)
    try:
        addresses.insert(0, str(ipaddress.ip_address(host)))  # a host given by address
    except ValueError:
        names.append(x509.DNSName(host))
    names += [x509.DNSName(d) for d in dns if d != host]
    for text in dict.fromkeys(addresses):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(text)))
        except ValueError:
            raise RQPError(f"--ip {text!r}: not an IP address") from None
    key = ec.generate_private_key(ec.SECP256R1())
    begin = _start(start)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(begin).not_valid_after(begin + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out = out or ca_dir
    crt, kf = out / f"{host}.crt", out / f"{host}.key"
    _write(kf, _key_pem(key), 0o600, force)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
    return crt, kf


def agent_pair(where: Path, receiver: str, sender: str, *, ca_name: str = "RQP CA",
               force: bool = False) -> tuple[dict, dict]:
    """A CA in ``where`` and certificates for a receiving MCA (named ``receiver``: its host
    name or address) and a sending MCA: the ``tls:`` blocks of their two configs (the demo,
    the benchmark and the tests run the agents over TLS with these)."""
    where.mkdir(parents=True, exist_ok=True)
    init_ca(where, name=ca_name, force=force)
    blocks = []
    for name in (receiver, sender):
        cert, key = issue(name, where, force=force)
        blocks.append({"cert": str(cert), "key": str(key), "ca": str(where / "ca.crt")})
    return blocks[0], blocks[1]


def show(path: Path) -> str:
    x509, *_ = _crypto()
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise RQPError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise RQPError(f"{path}: not a PEM certificate: {exc}") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    state = ("EXPIRED" if cert.not_valid_after_utc < now else
             "NOT YET VALID" if cert.not_valid_before_utc > now else
             f"{(cert.not_valid_after_utc - now).days} days left")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = san.get_values_for_type(x509.DNSName)
        ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        dns, ips = [], []
    cn = [a.value for a in cert.subject if a.oid == x509.oid.NameOID.COMMON_NAME]
    identity = (dns or cn or ["(none)"])[0]
    return "\n".join([
        f"identity:   {identity}" + ("  (DNS SAN)" if dns else "  (CN)" if cn else ""),
        f"DNS names:  {', '.join(dns) or '-'}",
        f"addresses:  {', '.join(ips) or '-'}",
        f"subject:    {cert.subject.rfc4514_string()}",
        f"issuer:     {cert.issuer.rfc4514_string()}",
        f"valid:      {cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
        f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC ({state})",
    ])


#: --days: a trial's "--days 0" was told "invalid _days value".
_days = number(int, minimum=1, what="a whole number of days")


def _date(text: str) -> datetime.datetime:
    value = datetime.datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)


def add_commands(groups) -> None:
    import argparse

    tls = groups.add_parser("tls", help="a certificate authority for RQP over TLS",
                            description=__doc__.split("\n\n")[0])
    commands = tls.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("init-ca", help="make a CA (ca.crt, ca.key) in DIR")
    p.add_argument("dir", metavar="DIR", type=Path)
    p.add_argument("--name", default="RQP CA", help="the CA's common name (default: RQP CA)")
    p.add_argument("--days", type=_days, default=CA_DAYS, metavar="N",
                   help=f"valid for N days (default {CA_DAYS})")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(run=_run_init)
    p = commands.add_parser("issue", help="make HOST.crt and HOST.key, signed by the CA")
    p.add_argument("host", metavar="HOST", help="the host's DNS name (its identity)")
    p.add_argument("--ca", metavar="DIR", type=Path, required=True,
                   help="the directory of ca.crt and ca.key")
    p.add_argument("--out", metavar="DIR", type=Path, help="where to write (default: the CA's)")
    p.add_argument("--ip", metavar="ADDRESS", action="append", default=[],
                   help="an address senders dial this host by (repeatable)")
    p.add_argument("--dns", metavar="NAME", action="append", default=[],
                   help="another DNS name of this host (repeatable)")
    p.add_argument("--days", type=_days, default=HOST_DAYS, metavar="N",
                   help=f"valid for N days (default {HOST_DAYS})")
    p.add_argument("--start", type=_date, metavar="ISO-DATE", help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(run=_run_issue)
    p = commands.add_parser("show", help="identity, issuer and validity of a certificate")
    p.add_argument("file", metavar="FILE", type=Path)
    p.set_defaults(run=lambda args: print(show(args.file)) or 0)


def _run_init(args) -> int:
    crt, key = init_ca(args.dir, name=args.name, days=args.days, force=args.force)
    print(f"CA certificate {crt} (give it to every host as tls.ca)\nCA key {key} (keep it "
          f"here, off the hosts)")
    return 0


def _run_issue(args) -> int:
    crt, key = issue(args.host, args.ca, args.out, ips=tuple(args.ip), dns=tuple(args.dns),
                     days=args.days, start=args.start, force=args.force)
    print(f"certificate {crt}\nkey {key} ({_key_access(key)})")
    return 0


def _key_access(key: Path) -> str:
    """Who may read ``key`` (mode 600), in words (a trial: it said "readable by the agents'
    user only" of a key owned by root, which the agents, run as rqp, could not read)."""
    import pwd

    uid = key.stat().st_uid
    try:
        owner = pwd.getpwuid(uid).pw_name
    except KeyError:
        owner = str(uid)
    if owner == AGENTS_USER:
        return f"mode 600, owner {AGENTS_USER}: readable by the agents' user only"
    return (f"mode 600, owner {owner}: on the host, the agents (user rqp) must read it: "
            "chown rqp there, e.g. in /etc/rqp/tls/")
