"""client_hung_up sees a FIN the event loop has not read yet, on real loopback sockets."""

import asyncio
import socket
import time

from kvrelay.gateway.api.hangup import client_hung_up


async def _accepted() -> tuple[asyncio.Transport, socket.socket, asyncio.Server]:
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport):
            accepted.set_result(transport)

    server = await asyncio.get_running_loop().create_server(Protocol, "127.0.0.1", 0)
    client = socket.create_connection(server.sockets[0].getsockname())
    return await asyncio.wait_for(accepted, 5), client, server


def test_a_connected_client_has_not_hung_up_even_with_unread_data():
    async def main():
        transport, client, server = await _accepted()
        client.sendall(b"GET / HTTP/1.1\r\n")
        time.sleep(0.05)  # the loop is held: the bytes wait unread
        assert not client_hung_up(transport)
        client.close()
        server.close()
    asyncio.run(main())


def test_a_fin_not_yet_read_by_the_loop_is_seen():
    async def main():
        transport, client, server = await _accepted()
        client.close()
        time.sleep(0.05)  # the loop is held: it has not read the FIN, so the transport looks open
        assert not transport.is_closing()
        assert client_hung_up(transport)
        server.close()
    asyncio.run(main())


def test_a_half_close_counts_as_a_hang_up():
    async def main():
        transport, client, server = await _accepted()
        client.shutdown(socket.SHUT_WR)
        time.sleep(0.05)
        assert client_hung_up(transport)
        client.close()
        server.close()
    asyncio.run(main())


def test_a_closing_or_missing_transport_has_hung_up():
    async def main():
        transport, client, server = await _accepted()
        transport.close()
        assert client_hung_up(transport)
        assert client_hung_up(None)
        client.close()
        server.close()
    asyncio.run(main())
