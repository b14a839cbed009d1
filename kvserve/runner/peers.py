"""The runner's end of block transfers between engines: where ``SendBlocks`` puts frames and
``ReceiveBlocks`` finds them. A frame is one block's verified object
(:mod:`kvserve.kv.tiers.object_format`); this module moves opaque bytes and never decodes them.

Two channels, named by the op's ``peer``:

* ``tcp://host:port/<transfer>``, the direct channel. The sender connects to the receiver's
  listener and names the transfer; the listener answers go or refused before any frame is
  sent. The sender then writes every frame; the listener stores them under the transfer and
  acknowledges. :meth:`PeerHub.send` returns only after that acknowledgement, so once it returns
  the receiver holds every frame.
* ``ray:<transfer>``, through Ray's object store. The frames wait in the sender's outbox until
  its caller takes them (:meth:`PeerHub.take_sent`: a Ray actor method returns them). Ray carries
  them to the receiver, whose caller hands them to :meth:`PeerHub.put`.

Invariants:
  * the inbox takes frames only for a transfer it expects (:meth:`expect`), and only once. A
    stranger's or a late transfer is refused, and a refused sender raises :class:`PeerError`;
  * nothing here blocks its caller longer than ``timeout_s``;
  * the listener binds one address (the node's, not every interface) and runs on daemon threads.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass

_MAGIC = b"KVPX"
_HEAD = struct.Struct("<4sHI")   # magic, transfer id length, frame count
_LEN = struct.Struct("<Q")
_ACK = struct.Struct("<cI")      # b"G" (send the frames), b"K" + frames stored, or b"N" (refused)


class PeerError(RuntimeError):
    """A transfer could not be delivered: refused, cut off, or too slow."""


@dataclass(frozen=True)
class PeerAddress:
    channel: str        # "tcp" or "ray"
    transfer: str
    host: str = ""
    port: int = 0

    @staticmethod
    def parse(peer: str) -> PeerAddress:
        if peer.startswith("ray:"):
            return PeerAddress("ray", peer[4:])
        if peer.startswith("tcp://"):
            hostport, _, transfer = peer[6:].partition("/")
            host, _, port = hostport.rpartition(":")
            if host and port.isdigit() and transfer:
                return PeerAddress("tcp", transfer, host, int(port))
        raise ValueError(f"a peer is 'tcp://host:port/<transfer>' or 'ray:<transfer>', got {peer!r}")


class PeerHub:
    """One engine's inbox, outbox and (once :meth:`address` is asked) TCP listener."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 5.0) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self._inbox: dict[str, list[bytes] | None] = {}
        self._outbox: dict[str, list[bytes]] = {}
        self._since: dict[str, float] = {}  # expected transfers: when
        self._lock = threading.Lock()
        self._server: socketserver.ThreadingTCPServer | None = None
        self.send_timeout_s = timeout_s  # what the next direct send may take (its caller sets it)
        self.bytes_sent = 0

    # -- receiving ---------------------------------------------------------------------------
    def expect(self, transfer: str) -> None:
        """Take frames for ``transfer`` from now on; transfers expected longer than a minute ago
        and never taken are forgotten here (their frames too)."""
        now = time.monotonic()
        with self._lock:
            for old in [t for t, at in self._since.items() if now - at > 60.0]:
                self._inbox.pop(old, None)
                self._since.pop(old, None)
            self._inbox[transfer] = None
            self._since[transfer] = now

    def put(self, transfer: str, frames: list[bytes]) -> bool:
        """Store ``frames`` for an expected transfer; False (nothing stored) otherwise."""
        with self._lock:
            if transfer not in self._inbox or self._inbox[transfer] is not None:
                return False
            self._inbox[transfer] = list(frames)
            self._since.pop(transfer, None)
            return True

    def take(self, transfer: str) -> list[bytes] | None:
        """The frames of ``transfer``, and forget it. None if they did not arrive: a later
        arrival is refused."""
        with self._lock:
            self._since.pop(transfer, None)
            return self._inbox.pop(transfer, None)

    def forget(self, transfer: str) -> None:
        with self._lock:
            self._inbox.pop(transfer, None)
            self._since.pop(transfer, None)
            self._outbox.pop(transfer, None)

    # -- sending -----------------------------------------------------------------------------
    def send(self, peer: str, frames: list[bytes]) -> None:
        addr = PeerAddress.parse(peer)
        if addr.channel == "ray":
            with self._lock:
                self._outbox[addr.transfer] = frames
        else:
            _send_tcp(addr, frames, self.send_timeout_s)
        self.bytes_sent += sum(map(len, frames))

    def take_sent(self, transfer: str) -> list[bytes]:
        """The frames a ``ray:`` send left for ``transfer`` (empty if none), and forget them."""
        with self._lock:
            return self._outbox.pop(transfer, [])

    # -- the listener ------------------------------------------------------------------------
    def address(self) -> str:
        """``tcp://host:port`` of this hub's listener (started on first use)."""
        if self._server is None:
            hub = self

            class Handler(socketserver.BaseRequestHandler):
                def handle(self) -> None:
                    hub._serve(self.request)

            server = socketserver.ThreadingTCPServer((self.host, 0), Handler, bind_and_activate=True)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, name="kvserve-peer", daemon=True).start()
            self._server = server
        host, port = self._server.server_address[:2]
        return f"tcp://{host}:{port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout_s)
        try:
            magic, tlen, n = _HEAD.unpack(_read(conn, _HEAD.size))
            if magic != _MAGIC:
                return
            transfer = _read(conn, tlen).decode()
            with self._lock:
                wanted = transfer in self._inbox and self._inbox[transfer] is None
            conn.sendall(_ACK.pack(b"G" if wanted else b"N", 0))  # refuse before a stranger's bytes come
            if not wanted:
                return
            frames = [_read(conn, _LEN.unpack(_read(conn, _LEN.size))[0]) for _ in range(n)]
            ok = self.put(transfer, frames)
            conn.sendall(_ACK.pack(b"K" if ok else b"N", len(frames) if ok else 0))
        except (OSError, struct.error, UnicodeDecodeError):
            return  # a cut-off or malformed sender: it sees no acknowledgement


def _read(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise OSError("peer closed the connection")
        got += k
    return bytes(buf)


def _send_tcp(addr: PeerAddress, frames: list[bytes], timeout_s: float) -> None:
    tid = addr.transfer.encode()
    try:
        with socket.create_connection((addr.host, addr.port), timeout=timeout_s) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(_HEAD.pack(_MAGIC, len(tid), len(frames)) + tid)
            tag, _ = _ACK.unpack(_read(conn, _ACK.size))
            if tag != b"G":
                raise PeerError(f"{addr.host}:{addr.port} refused transfer {addr.transfer!r}")
            for f in frames:
                conn.sendall(_LEN.pack(len(f)))
                conn.sendall(f)
            tag, n = _ACK.unpack(_read(conn, _ACK.size))
    except OSError as exc:
        raise PeerError(f"sending {len(frames)} blocks to {addr.host}:{addr.port} failed: {exc}") from None
    if tag != b"K" or n != len(frames):
        raise PeerError(f"{addr.host}:{addr.port} refused transfer {addr.transfer!r}")
