"""CURVE on every internal ZMQ socket: one deployment secret (32 bytes, given as 64 hex digits) is the
CURVE secret key of every process, so all of them share one keypair. A socket that binds (the decode
worker's handoff ROUTER, the gateway's token-event PULL) is a CURVE server whose ZAP handler admits
only that public key; a socket that connects presents the keypair. A peer without the secret fails the
handshake inside libzmq: none of its messages reaches our code, and nothing is logged per attempt.

``serve`` and ``dial`` are the only ways a socket is set up, before it binds or connects; with no keys
(``--insecure-zmq``) they leave the socket as it is.
"""

import threading
from dataclasses import dataclass

import zmq
from zmq.utils import z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27): one handler per libzmq context
ZAP_DOMAIN = b"kvrelay"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # Z85, as libzmq takes keys
    secret: bytes = b""

    def __repr__(self) -> str:  # a config or exception printing its holder never shows the secret
        return f"CurveKeys(public={self.public.decode()})"


def keys_from_secret(secret_hex: str | None, insecure: bool = False) -> CurveKeys | None:
    """The deployment's keypair from its secret; None (no authentication) only when that was asked for,
    however the config was built (flags, a parent's JSON, a test)."""
    if secret_hex is None:
        if insecure:
            return None
        raise ValueError("no ZMQ secret: give --zmq-secret-file or $KVRELAY_ZMQ_SECRET (kvrelay serve makes one), "
                         "or --insecure-zmq")
    secret = z85.encode(bytes.fromhex(secret_hex))
    return CurveKeys(public=zmq.curve_public(secret), secret=secret)


def serve(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """A socket that binds: CURVE server, admitting only peers holding the deployment's secret."""
    if keys is None:
        return
    _ZapHandler.ensure(sock.context, keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    # fail closed: without a ZAP handler libzmq would admit any client that knows the public key
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def dial(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """A socket that connects: CURVE client with the deployment's keypair, expecting the same key."""
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


class _ZapHandler:
    """Answers a context's ZAP requests on a thread of its own: 200 for a CURVE client whose (proven)
    public key is the deployment's, 400 for anyone else. Bound before the server socket binds, so no
    handshake can come before it; it ends when the context is terminated."""

    _running: dict[int, bytes] = {}  # libzmq context address -> the public key it admits
    _lock = threading.Lock()

    @classmethod
    def ensure(cls, ctx: zmq.Context, public: bytes) -> None:
        with cls._lock:
            admitted = cls._running.get(ctx.underlying)
            if admitted is not None:
                if admitted != public:
                    raise ValueError("this ZMQ context already admits another deployment's key")
                return
            sync_ctx = zmq.Context.shadow(ctx.underlying)  # a zmq.asyncio context's sockets cannot block
            sock = sync_ctx.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
            cls._running[ctx.underlying] = public
        threading.Thread(target=cls._answer, args=(sock, ctx.underlying, public), daemon=True,
                         name="zmq-zap").start()

    @classmethod
    def _answer(cls, sock: zmq.Socket, key: int, public: bytes) -> None:
        raw_public = z85.decode(public)
        try:
            while True:
                # version, request id, domain, address, identity, mechanism, credentials...
                frames = sock.recv_multipart()
                version, request_id, mechanism = frames[0], frames[1], frames[5]
                ok = mechanism == b"CURVE" and len(frames) > 6 and frames[6] == raw_public
                sock.send_multipart([version, request_id, b"200" if ok else b"400",
                                     b"OK" if ok else b"not this deployment's key", b"", b""])
        except zmq.ContextTerminated:
            pass
        finally:
            with cls._lock:  # before close: once the context's term() returns, its address may be reused
                cls._running.pop(key, None)
            sock.close(linger=0)
