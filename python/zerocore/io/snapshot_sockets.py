"""The mirrors' transport where the data plane is gloo (io/snapshot_transport.py
chooses it): TCP sockets of the snapshots' own thread, one connection a
direction a pair, at the address gloo's default device takes.

Not a gloo group: a process's gloo groups all move their bytes through one
TCP loop thread (gloo's device loop is shared), so a mirror over one (a
rank's whole partition, ~12 bytes a param of it with Adam) would be read
and written by the thread the data group's collectives wait for, at the
training's priority. Here the bytes are the snapshots' thread's own
work, which runs at a lower priority (snapshot.Snapshots): its CPU fills
the training threads' waits rather than taking from their compute
(bench/RESULTS.md: 2-3 points of the step at the median on the 2-core CPU
bench, where both cores train).

Each rank listens at construction (its address gathered over the
snapshots' gloo group, a collective call of the engine's ranks) and
connects to a peer at its first exchange with it, on the snapshots'
thread: the connection's first 8 bytes name the rank that made it. A
peer that closes its end or sends nothing for the group's timeout raises,
naming it (the snapshot's error, raised on the training thread at the next
snapshot).
"""
from __future__ import annotations

import fcntl
import os
import selectors
import socket
import struct
import time

import torch
import torch.distributed as dist

from zerocore.comm.process_group import group_timeout

_HELLO = struct.Struct("<q")  # a connection's first bytes: the rank that made it
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def listening_address() -> str:
    """Where gloo's default device listens, so that the mirrors use the data
    plane's network: GLOO_SOCKET_IFNAME's first interface where it is set;
    else the first of the host name's addresses a socket binds to; else the
    loopback address."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
            except OSError as e:
                raise ValueError(f"zerocore: the snapshot mirrors listen where gloo does: GLOO_SOCKET_IFNAME names "
                                 f"{interface!r}, which has no IPv4 address here ({e})") from e
        return socket.inet_ntoa(packed[20:24])
    for family, _, _, _, address in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address[0], 0))
            except OSError:
                continue
        return address[0]
    return "127.0.0.1"


class SocketTransport:
    """The mirrors' bytes sent as they are, host memory to host memory, over
    TCP connections of their own to the peers; `group` (gloo, the engine's
    ranks) only gathers the addresses, and gives the timeout where
    `timeout` (Config.timeout) is None."""

    device_bytes = 0  # it holds no buffer of its own

    def __init__(self, group, timeout=None):
        timeout = timeout or group_timeout(group)
        self.timeout = timeout.total_seconds() if timeout is not None else None
        host = listening_address()
        self._listener = socket.create_server((host, 0), family=socket.getaddrinfo(host, None)[0][0],
                                              backlog=dist.get_world_size(group))
        self._listener.settimeout(self.timeout)
        self.rank = dist.get_rank(group)
        self.addresses = [None] * dist.get_world_size(group)
        dist.all_gather_object(self.addresses, (host, self._listener.getsockname()[1]), group=group)
        self._to, self._from = {}, {}  # peer rank -> its connection, one each way
        self._failed = None  # the error an exchange raised

    def exchange(self, out: torch.Tensor, dst: int, into: torch.Tensor, src: int):
        """Sends `out` to rank `dst` while rank `src`'s bytes arrive into
        `into` (as many as it holds); returns when both are done. After a
        failure the connections are mid-stream: every later exchange
        raises it again."""
        if self._failed is not None:
            raise ConnectionError(f"zerocore: the snapshot mirrors stopped at an earlier failure ({self._failed})")
        try:
            self._exchange(out, dst, into, src)
        except OSError as e:  # ConnectionError and TimeoutError are OSErrors
            self._failed = e
            raise

    def _exchange(self, out, dst, into, src):
        """exchange's bytes, both sockets non-blocking under one selector."""
        sending, receiving = self._connection_to(dst), self._connection_from(src)
        outgoing, incoming = memoryview(out.numpy()), memoryview(into.numpy())
        sent = received = 0
        with selectors.DefaultSelector() as selector:
            if len(outgoing):
                selector.register(sending, selectors.EVENT_WRITE)
            if len(incoming):
                selector.register(receiving, selectors.EVENT_READ)
            moved_at = time.monotonic()  # the timeout counts from the last byte moved
            while selector.get_map():
                wait = None if self.timeout is None else max(0.0, moved_at + self.timeout - time.monotonic())
                if not selector.select(wait):
                    waiting = f"rank {dst} to take" if sent < len(outgoing) else f"rank {src} to send"
                    raise TimeoutError(f"zerocore: a snapshot mirror waited {self.timeout:.0f} s for {waiting} "
                                       f"more of its bytes ({sent} of {len(outgoing)} sent, {received} of "
                                       f"{len(incoming)} received)")
                moved = sent + received
                if sent < len(outgoing):
                    sent += self._sent(sending, outgoing[sent:], dst)
                    if sent == len(outgoing):
                        selector.unregister(sending)
                if received < len(incoming):
                    received += self._received(receiving, incoming[received:], src)
                    if received == len(incoming):
                        selector.unregister(receiving)
                if sent + received > moved:
                    moved_at = time.monotonic()

    def _sent(self, connection, data, peer) -> int:
        try:
            return connection.send(data)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise ConnectionError(f"zerocore: rank {peer}'s snapshot mirror connection failed ({e}): "
                                  f"is rank {peer} alive?") from e

    def _received(self, connection, into, peer) -> int:
        try:
            n = connection.recv_into(into)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise ConnectionError(f"zerocore: rank {peer}'s snapshot mirror connection failed ({e}): "
                                  f"is rank {peer} alive?") from e
        if n == 0:
            raise ConnectionError(f"zerocore: rank {peer} closed its snapshot mirror connection with "
                                  f"{len(into)} bytes still to come: is rank {peer} alive?")
        return n

    def _connection_to(self, peer: int) -> socket.socket:
        if peer not in self._to:
            try:
                connection = socket.create_connection(self.addresses[peer], timeout=self.timeout)
                connection.sendall(_HELLO.pack(self.rank))
            except OSError as e:
                raise ConnectionError(f"zerocore: no snapshot mirror connection to rank {peer} at "
                                      f"{self.addresses[peer]} ({e}): is rank {peer} alive?") from e
            connection.setblocking(False)
            self._to[peer] = connection
        return self._to[peer]

    def _connection_from(self, peer: int) -> socket.socket:
        """The connection rank `peer` made (those of other peers accepted
        meanwhile are kept for their turn)."""
        while peer not in self._from:
            try:
                connection, _ = self._listener.accept()
            except TimeoutError as e:
                raise TimeoutError(f"zerocore: rank {peer} made no snapshot mirror connection within "
                                   f"{self.timeout:.0f} s: is it alive?") from e
            connection.settimeout(self.timeout)
            hello = bytearray()
            while len(hello) < _HELLO.size:
                piece = connection.recv(_HELLO.size - len(hello))
                if not piece:
                    raise ConnectionError(f"zerocore: a snapshot mirror connection closed before naming its rank "
                                          f"(rank {peer}'s was awaited)")
                hello += piece
            connection.setblocking(False)
            self._from[_HELLO.unpack(hello)[0]] = connection
        return self._from[peer]

    def close(self):
        for connection in [self._listener, *self._to.values(), *self._from.values()]:
            connection.close()
