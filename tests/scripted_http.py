"""A real HTTP server on loopback answering every GET with 200 and the next JSON body of a script (the last one
from then on), counting the requests: a stand-in for a gateway's /ready in tests of what polls it."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedJSON:
    def __init__(self, bodies: list[dict]):
        self.bodies, self.polls = bodies, 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802  # http.server's name
                body = json.dumps(owner.bodies[min(owner.polls, len(owner.bodies) - 1)]).encode()
                owner.polls += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
