"""A TCP relay between one NATS client and nats-server that holds the client's outgoing
bytes from its first publish on a subject prefix until the test releases them.

It plays a publish the stream answers late (a stalled link, a leader election): the
client's reads before that publish go through, the publish and everything the client
sends after it wait, and ``cut()`` drops them, as a sink that dies mid-write would.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlparse


class PublishGate:
    """Relay to ``server_url``; holds the client's bytes from the first ``PUB <prefix>``."""

    def __init__(self, server_url: str, prefix: str) -> None:
        parsed = urlparse(server_url)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 4222)
        self._trigger = b"PUB " + prefix.encode()
        self.holding = asyncio.Event()
        """Set once the gated publish has been seen and held."""
        self._released = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._pumps: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        """Listen on a free loopback port; the URL a client connects to."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"nats://127.0.0.1:{port}"

    def release(self) -> None:
        """Let the held bytes through, and everything after them."""
        self._released.set()

    async def cut(self) -> None:
        """Drop every connection; the held bytes never reach the server."""
        for task in self._pumps:
            task.cancel()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self._upstream)
        self._writers += [client_w, server_w]
        for pump in (self._outgoing(client_r, server_w), _copy(server_r, client_w)):
            task = asyncio.create_task(pump)
            self._pumps.add(task)

    async def _outgoing(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                at = -1 if self.holding.is_set() else chunk.find(self._trigger)
                if at >= 0:
                    start = at - 1 if chunk[at - 1 : at] == b"H" else at  # HPUB or PUB
                    writer.write(chunk[:start])
                    await writer.drain()
                    self.holding.set()
                    await self._released.wait()
                    chunk = chunk[start:]
                writer.write(chunk)
                await writer.drain()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
