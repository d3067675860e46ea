"""Throwaway backing services for tests and benchmarks: a redis-server and an S3 endpoint.

* :func:`start_redis` runs ``redis-server --port <free> --save "" --appendonly no`` (no
  persistence) as a child process and yields its ``redis://127.0.0.1:<port>/0`` URL.
  :func:`start_redis_process` with ``tls=True`` serves TLS only instead (``--port 0
  --tls-port <free>``, ``rediss://127.0.0.1:<port>/0``) with certificates of a throwaway CA
  that :func:`make_tls_files` writes into the server's temporary directory.
* :func:`start_s3` runs moto's S3 server (a real HTTP S3 endpoint) as a child process on a
  free port, creates a bucket and yields ``(endpoint_url, bucket)``.

Both stop what they started on exit. Neither is for production: real deployments point
``redis_url`` / ``s3_url`` at real services.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

# Ray's worker processes listen on 10002-19999 by default (``--min/max-worker-port``).
_FIXED_PORTS_FROM = 20000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; 32768-60999 if unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    return 32768, 60999


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago, chosen below the kernel's ephemeral
    range and above Ray's worker ports: a port from ``bind(0)`` is an ephemeral one, which any
    outgoing connection (Ray's, redis-py's) may take as its local port before the service we
    pick it for binds it (``Address already in use``). Falls back to ``bind(0)`` when there is
    no such range or 64 random tries found nothing free."""
    lo, _ = _ephemeral_range()
    if lo - _FIXED_PORTS_FROM >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_FIXED_PORTS_FROM, lo)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM ``proc`` if it runs, SIGKILL it after ``grace_s`` seconds; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"service on port {port} exited with code {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"service on port {port} did not start within {timeout_s} s")


@dataclass(frozen=True)
class TLSFiles:
    """PEM files (paths) of a throwaway CA and the certificates it signed (:func:`make_tls_files`)."""

    ca_file: str             # the CA's certificate: what clients and the server trust
    server_cert_file: str    # for 127.0.0.1 and localhost (subjectAltName), serverAuth
    server_key_file: str
    client_cert_file: str    # clientAuth, for ``tls-auth-clients yes``
    client_key_file: str


def make_tls_files(directory: str, name: str = "kvblend-test") -> TLSFiles:
    """Write a new CA (P-256 keys, valid from an hour ago for a day) and a server and a client
    certificate it signed into ``directory``; the CA's key is never written. For tests and
    benches only: every call makes an unrelated CA (a "wrong CA" for another's server).

    Returns:
        The paths, files ``<name>-ca.crt``, ``<name>-server.{crt,key}``, ``<name>-client.{crt,key}``
        (keys mode 0600).

    Raises:
        RuntimeError: the ``cryptography`` package is missing.
    """
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:
        raise RuntimeError(f"make_tls_files needs the cryptography package: {e}") from None

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA {uuid.uuid4().hex[:8]}")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=True, crl_sign=True,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(ca_ski, critical=False)
               .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage, san: list | None) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
                   .issuer_name(ca_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                                  critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                  critical=False))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    server = leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH,
                  [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    client = leaf(f"{name} client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    files = TLSFiles(*(os.path.join(directory, f"{name}-{part}") for part in (
        "ca.crt", "server.crt", "server.key", "client.crt", "client.key")))
    for path, data in ((files.ca_file, ca_cert.public_bytes(serialization.Encoding.PEM)),
                       (files.server_cert_file, server[0]), (files.server_key_file, server[1]),
                       (files.client_cert_file, client[0]), (files.client_key_file, client[1])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if path.endswith(".key") else 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    return files


_TLS_AUTH_CLIENTS = ("no", "yes", "optional")


class RedisProcess:
    """A running ``redis-server`` child (see :func:`start_redis`); ``kill()`` stops it hard
    (tests use it to simulate a dead Redis) and ``restart()`` brings it back on the same port.

    With ``tls=True`` it serves TLS only on ``port`` (``url`` is ``rediss://``); ``tls`` holds
    the :class:`TLSFiles` (made once, so a restart keeps them) and ``tls_auth_clients``
    (``no``, ``yes``, ``optional``) is redis-server's ``--tls-auth-clients``.

    Raises:
        ValueError: ``tls_auth_clients`` is none of those.
    """

    def __init__(self, port: int, extra_args: tuple[str, ...] = (), *, tls: bool = False,
                 tls_auth_clients: str = "no") -> None:
        if tls_auth_clients not in _TLS_AUTH_CLIENTS:
            raise ValueError(f"tls_auth_clients={tls_auth_clients!r}: choose one of {_TLS_AUTH_CLIENTS}")
        self.port = port
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0"
        self._args = extra_args
        self._dir = tempfile.mkdtemp(prefix="kvblend-redis-")
        self.tls_auth_clients = tls_auth_clients
        self.proc: subprocess.Popen | None = None
        try:
            self.tls: TLSFiles | None = make_tls_files(self._dir) if tls else None
            self.start()
        except BaseException:
            self.stop()  # the child, if any, and the temporary directory
            raise

    def config_values(self) -> dict[str, str]:
        """The :class:`tiers.config.TiersConfig` fields that reach this server: ``redis_url``
        and, with TLS, ``redis_tls_ca_file`` (plus the client certificate and key when the
        server asks for one: ``tls_auth_clients`` yes/optional)."""
        out = {"redis_url": self.url}
        if self.tls is not None:
            out["redis_tls_ca_file"] = self.tls.ca_file
            if self.tls_auth_clients != "no":
                out["redis_tls_cert_file"] = self.tls.client_cert_file
                out["redis_tls_key_file"] = self.tls.client_key_file
        return out

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        listen = ["--port", str(self.port)]
        if self.tls is not None:
            listen = ["--port", "0", "--tls-port", str(self.port),
                      "--tls-cert-file", self.tls.server_cert_file,
                      "--tls-key-file", self.tls.server_key_file,
                      "--tls-ca-cert-file", self.tls.ca_file,
                      "--tls-auth-clients", self.tls_auth_clients]
        self.proc = subprocess.Popen(
            [exe, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir, *self._args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, 10.0, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def start_redis_process(*extra_args: str, tls: bool = False,
                        tls_auth_clients: str = "no") -> Iterator[RedisProcess]:
    """Like :func:`start_redis` but yields the :class:`RedisProcess` (to kill/restart it;
    ``tls=True``: a TLS-only server, its certificates in ``.tls``, see :class:`RedisProcess`).

    Raises:
        RuntimeError: redis-server missing or not listening within 10 s; with ``tls``, the
            ``cryptography`` package missing.
        ValueError: a bad ``tls_auth_clients``.
    """
    proc = RedisProcess(free_port(), extra_args, tls=tls, tls_auth_clients=tls_auth_clients)
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def start_redis(*extra_args: str) -> Iterator[str]:
    """Run a private redis-server; yields its URL (``redis://127.0.0.1:<port>/0``).

    Args:
        extra_args: more ``redis-server`` arguments, e.g. ``"--proto-max-bulk-len", "1mb"``
            (for a TLS server, whose URL alone is not enough, use :func:`start_redis_process`).

    Raises:
        RuntimeError: redis-server missing or not listening within 10 s.
    """
    with start_redis_process(*extra_args) as proc:
        yield proc.url


_FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kvblend-test", "AWS_SECRET_ACCESS_KEY": "kvblend-test",
                     "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def start_s3(bucket: str | None = None) -> Iterator[tuple[str, str]]:
    """Run moto's S3 server (``python -m moto.server``) as a child process on a free port with
    one bucket; yields ``(endpoint_url, bucket)``.

    A child process, not moto's ``ThreadedMotoServer`` in this one: importing moto's server
    puts Flask's ``LocalProxy`` objects into ``sys.modules``, and an in-process vLLM engine
    started later walks ``sys.modules`` (``vllm.triton_utils``) and dies on them. The caller's
    process never imports moto.

    boto3 finds credentials through its standard chain; where none are set, this sets
    throwaway ``AWS_*`` environment variables for the duration (moto accepts any) and
    restores the environment afterwards.

    Raises:
        RuntimeError: moto or boto3 not installed, or the server not listening within 20 s.
    """
    try:
        import boto3
    except ImportError as e:
        raise RuntimeError(f"start_s3 needs boto3: {e}") from None
    if importlib.util.find_spec("moto") is None:
        raise RuntimeError("start_s3 needs moto[server] (pip install 'moto[server]')")
    saved = {k: os.environ.get(k) for k in _FAKE_CREDENTIALS}
    for k, v in _FAKE_CREDENTIALS.items():
        os.environ.setdefault(k, v)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, 20.0, proc)
        endpoint = f"http://127.0.0.1:{port}"
        bucket = bucket or f"kvblend-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield endpoint, bucket
    finally:
        stop_process(proc)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
