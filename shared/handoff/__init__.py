"""The KV handoff: a finished prefill's KV blocks moved into a decode worker's granted blocks. It is the
engine's KV connector: it reaches a model's KV only through ``EngineCore.kv`` (shared/engine/kv_connector.py:
reserve, free, park and release blocks; the KV cache and block ids) and is called back by the forward
through ``LayerStream``, its ``LayerSaver``.

base.py       the interfaces: a Transport gives a KVSender (prefill side) and a KVReceiver (decode side)
states.py     the state table of a transfer on the prefill side
sender.py     the prefill side's mechanics: its transfers' state machine; sender_io.py their asks, replies and
              cancels; kv_out.py a granted transfer's KV leaving (outbound.py builds what goes out)
receiver.py   the decode side's mechanics: the messages it takes; seats.py what it holds for which request
              (grants.py the grants, incoming.py the transfers arriving into them); inbox_socket.py its socket
frames.py     host-staged frames over ZMQ (any two hosts); rank_parts.py the parts a sharded worker's ranks
              send; assembler.py what their receivers share; pool.py the threads that check and write them
direct.py     direct writes into the decode worker's cache, reached through cuda_ipc.py (one GPU) or
              fake.py (one process, for tests)
transports.py the default transports; blocks.py layouts and block copies; waker.py wakes a worker loop;
standalone.py endpoints with a KV cache and no model (the handoff's benchmark and tests)
"""
