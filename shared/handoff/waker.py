"""Lets pool threads wake a worker loop blocked in ``zmq.Poller.poll``."""

import os


class Waker:
    """A pipe whose read end the loop polls, so a staged layer or a finished write is acted on at once
    rather than at the next poll timeout."""

    def __init__(self):
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self, *_args) -> None:
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):  # full: a wake-up is already pending; closed: shutting down
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._w)
