"""The test session's ZMQ deployment secret: in the environment of every process the tests start (as an
operator would give standalone roles ``$KVRELAY_ZMQ_SECRET``), and the keys harness sockets use to take
part in that deployment."""

import os

from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV, generate
from kvrelay.shared.wire.zmq_auth import keys_from_secret

SECRET = os.environ.setdefault(ZMQ_SECRET_ENV, generate())
CURVE = keys_from_secret(SECRET)
