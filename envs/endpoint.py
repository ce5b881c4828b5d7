"""An OpenAI-compatible HTTP endpoint inside a rollout worker: agent code written against the `openai` client
drives episodes, and the worker trains on exactly what it served.

    endpoint = Endpoint()                              # 127.0.0.1, a free port; a daemon thread serves it
    client = openai.OpenAI(base_url=endpoint.url, api_key=episode_key(17))   # one key per episode
    for call in endpoint.calls(): ...                  # the worker's loop takes each request ...
    call.answer(200, {...})                            # ... and answers it once the engine has

Only I/O happens on the server's threads: a request is parsed, queued as a `Call` and waits for its answer.
The rollout worker's own thread renders, tokenizes and drives the engine (envs/agent.py), so the engine and
the tokenizer are never touched from two threads. Routes: POST /v1/chat/completions, POST /v1/completions,
GET /v1/models. Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "code"}}`), one line each.
"""
import json
import queue
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEY_PREFIX = "ringrl-episode-"
MODEL = "ringrl-policy"  # the one model an endpoint serves: the worker's current policy
MAX_BODY = 8 << 20  # bytes of one request: a longer conversation is refused, not read


def episode_key(key: int) -> str:
    """The API key that names episode `key` to the endpoint."""
    return f"{KEY_PREFIX}{key}"


@dataclass
class Call:
    """One request, from a server thread to the worker's loop and back."""
    route: str  # "chat" | "completions"
    key: int | None  # the episode its API key names (None: no or a foreign key)
    body: dict
    status: int = 0
    reply: dict = field(default_factory=dict)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def answer(self, status: int, reply: dict) -> None:
        self.status, self.reply = status, reply
        self._done.set()

    def fail(self, status: int, message: str, code: str = "invalid_request") -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self.answer(status, {"error": {"message": message, "type": kind, "code": code}})

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


class Endpoint:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, answer_timeout_s: float = 600.0):
        """Loopback by default: the endpoint serves whatever process can reach it, with no authentication
        beyond the episode keys. answer_timeout_s: how long a request waits for the worker before a 504."""
        self.inbox: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self.answer_timeout_s = answer_timeout_s
        self.server = _Server((host, port), _handler(self))
        self.url = f"http://{host}:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, name="endpoint", daemon=True)
        self._thread.start()
        self.closed = False

    def calls(self) -> list[Call]:
        """Requests that arrived since the last call, oldest first (never blocks)."""
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Stop serving; requests still queued are answered 503."""
        if self.closed:
            return
        self.closed = True
        self.server.shutdown()
        self.server.server_close()
        for call in self.calls():
            call.fail(503, "the rollout worker is stopping", "unavailable")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Every episode of a few groups connects at once when they start: the stdlib's backlog of 5 refuses most
    # of them (the client's APIConnectionError)
    request_queue_size = 1024


def _handler(endpoint: Endpoint):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects

        def log_message(self, *args) -> None:  # no line per request on stderr
            pass

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                model = {"id": MODEL, "object": "model", "owned_by": "ringrl"}
                self._send(200, {"object": "list", "data": [model]})
            else:
                self._error(404, f"no route GET {self.path}; this endpoint serves POST /v1/chat/completions "
                                 "and /v1/completions", "not_found")

        def do_POST(self) -> None:
            routes = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
            route = routes.get(self.path.rstrip("/"))
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self.close_connection = True
                return self._error(413, f"request body over {MAX_BODY >> 20} MiB", "too_large")
            raw = self.rfile.read(length)
            if route is None:
                return self._error(404, f"no route POST {self.path}", "not_found")
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body is not a JSON object")
            except ValueError as error:
                return self._error(400, f"the body is not valid JSON: {error}", "invalid_json")
            if body.get("stream"):
                return self._error(400, "stream=true is not supported; ask without streaming", "unsupported")
            call = Call(route, _key(self.headers.get("Authorization", "")), body)
            endpoint.inbox.put(call)
            if not call.wait(endpoint.answer_timeout_s):
                return self._error(504, "the rollout worker did not answer in time", "timeout")
            self._send(call.status, call.reply)

        def _error(self, status: int, message: str, code: str) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._send(status, {"error": {"message": message, "type": kind, "code": code}})

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _key(authorization: str) -> int | None:
    token = authorization.removeprefix("Bearer ").strip()
    if not token.startswith(KEY_PREFIX) or not token[len(KEY_PREFIX):].isdigit():
        return None
    return int(token[len(KEY_PREFIX):])
