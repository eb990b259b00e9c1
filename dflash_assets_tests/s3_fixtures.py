"""A real S3-compatible endpoint on loopback for the storage tests: ``moto_server`` (from moto[server])
in a subprocess, plus a TCP proxy in front of it that can be stopped and restarted on the same port
(an endpoint outage that, unlike restarting the in-memory moto server, keeps the stored objects).

Fixtures (import them into the test module: ``from s3_fixtures import moto_server, s3_env, s3_target``):

* ``moto_server`` (session): a started :class:`MotoServer`; ``.url`` is ``http://127.0.0.1:<port>``.
* ``s3_env`` (function): random fake AWS credentials in the environment (``.access_key``, ``.secret_key``).
* ``s3_target`` (function): a fresh bucket behind a fresh :class:`TcpProxy`; ``.root`` (``s3://...``),
  ``.endpoint_url`` (the proxy), ``.proxy``, ``.client`` (boto3, direct to moto), ``.bucket``, ``.prefix``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_server_bin() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "moto_server")
    found = here if os.path.exists(here) else shutil.which("moto_server")
    if not found:
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    return found


class MotoServer:
    """``moto_server -H 127.0.0.1 -p PORT`` as a subprocess (in-memory S3; ~4 s to start)."""

    def __init__(self, log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [_moto_server_bin(), "-H", "127.0.0.1", "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}; see {log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"moto_server did not listen on {self.url} within 60 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``upstream``; :meth:`stop` refuses new connections and resets open
    ones (the endpoint is down), :meth:`start` listens again on the same port (it is back)."""

    def __init__(self, upstream_port: int, port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.bytes_from_upstream = 0  # what clients received: an S3 read's transfer, headers included

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    @property
    def running(self) -> bool:
        return self._listener is not None

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if src.getpeername()[1] == self.upstream_port:
                    with self._lock:
                        self.bytes_from_upstream += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)

    def stop(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
                s.close()
            except OSError:
                pass


@dataclass
class S3Creds:
    access_key: str
    secret_key: str


@dataclass
class S3Target:
    bucket: str
    prefix: str
    endpoint_url: str
    proxy: TcpProxy
    client: Any  # boto3 S3 client talking to moto directly (not through the proxy)

    @property
    def root(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def keys(self, under: str = "") -> list[str]:
        """Object keys below ``prefix/under``, relative to ``prefix``, sorted."""
        full = f"{self.prefix}/{under}".rstrip("/")
        out, token = [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": full}
            if token:
                kw["ContinuationToken"] = token
            page = self.client.list_objects_v2(**kw)
            out += [o["Key"][len(self.prefix) + 1 :] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(out)
            token = page["NextContinuationToken"]

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    server = MotoServer(str(tmp_path_factory.mktemp("moto") / "moto_server.log"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(monkeypatch) -> S3Creds:
    creds = S3Creds("AKIA" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return creds


@pytest.fixture
def s3_target(moto_server, s3_env):
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=moto_server.url,
        region_name="us-east-1",
        aws_access_key_id=s3_env.access_key,
        aws_secret_access_key=s3_env.secret_key,
    )
    bucket = f"dflash-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    proxy = TcpProxy(moto_server.port).start()
    yield S3Target(bucket, "run", proxy.url, proxy, client)
    proxy.stop()
