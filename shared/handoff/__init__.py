"""The KV handoff: a finished prefill's KV blocks moved into a decode worker's granted blocks.

base.py       the interfaces: a Transport gives a KVSender (prefill side) and a KVReceiver (decode side)
states.py     the state table of a transfer on the prefill side
sender.py     the prefill side's mechanics; receiver.py the decode side's
frames.py     host-staged frames over ZMQ (any two hosts)
direct.py     direct writes into the decode worker's cache, reached through cuda_ipc.py (one GPU) or
              fake.py (one process, for tests)
transports.py the default transports; blocks.py layouts and block copies; waker.py wakes a worker loop; standalone.py endpoints without an engine
"""
