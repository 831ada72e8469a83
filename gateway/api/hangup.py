"""Has a client hung up? Asked of the socket itself, not only of what the event loop has read so far.

A transport is closing once the loop has read the client's FIN, but a busy loop may run a handler's
wake-up (already queued) before the read callback that would tell it so. Work that is costly to undo
(queuing jobs for workers) looks at the socket: poll with POLLRDHUP sees a FIN the loop has not read yet.
"""

import asyncio
import select

# Linux only; elsewhere the transport's own state is all we know
_RDHUP = getattr(select, "POLLRDHUP", 0)


def client_hung_up(transport: asyncio.BaseTransport | None) -> bool:
    if transport is None or transport.is_closing():
        return True
    sock = transport.get_extra_info("socket")
    if not _RDHUP or sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), _RDHUP)
    # a half-close counts: aiohttp closes the transport on the FIN it reads (eof_received keeps nothing open)
    return any(events & (_RDHUP | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))
