"""One streamed completion request over a plain socket, timing the arrival of every token.

``POST /v1/completions`` (OpenAI-compatible, ``stream: true``): the server sends an SSE event per token, or several
tokens in one event when it falls behind (vLLM's API process; speculative decoding). An event that lists its
``token_ids`` (vLLM's ``return_token_ids``) counts as that many tokens, all arriving when the event did (the gaps
between them are zero: they were received together); one that does not counts as one. The time of a token is the time
the bytes holding its event came off the socket (``clock()`` right after ``recv``). The server's ``usage`` closes the
stream and is kept, so that the count can be checked against it.

This module uses the standard :mod:`socket` module through attribute lookups at call time, so inside the load
process (where Locust/gevent has monkey-patched it) every request is a cooperative greenlet; it works with plain
threads too.
"""

from __future__ import annotations

import errno
import json
import math
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

from loadtest.http_stream import HTTPError, ResponseParser, SSEParser


@dataclass
class StreamResult:
    send_time: float = math.nan  # clock() when the request started (before connecting); set here unless given
    token_times: list[float] = field(default_factory=list)  # clock() at each token's arrival
    finish_time: float = math.nan
    last_activity: float = math.nan  # clock() of the last bytes received (or of the send)
    http_status: int = 0
    error: str = ""
    done: bool = False  # the response ended normally
    usage: dict | None = None
    events: int = 0  # events that carried tokens
    multi_token_events: int = 0  # events that carried more than one token


def completions_path(url: str) -> str:
    base = urlsplit(url).path.rstrip("/")
    return base + ("/completions" if base.endswith("/v1") else "/v1/completions")


class Endpoint:
    """Where requests go, with a small pool of idle keep-alive connections."""

    def __init__(self, url: str, path: str | None = None, timeout: float = 120.0, max_idle_s: float = 2.0,
                 io_timeout: bool = True) -> None:
        """``timeout``: connecting, and with ``io_timeout`` every send/receive too; without it a caller watches
        ``StreamResult.last_activity`` (one timer per read costs more than the rest of handling a token)."""
        u = urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"url must be http(s)://HOST:PORT, got {url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.path = path or completions_path(url)
        self.timeout = timeout
        self.io_timeout = io_timeout
        self.max_idle_s = max_idle_s
        self._idle: list[tuple[float, socket.socket]] = []
        self._addr: tuple | None = None
        self._ssl_ctx = ssl.create_default_context() if self.tls else None
        host_hdr = self.host if self.port in (80, 443) else f"{self.host}:{self.port}"
        self._head = (f"POST {self.path} HTTP/1.1\r\nHost: {host_hdr}\r\nContent-Type: application/json\r\n"
                      f"Accept: text/event-stream\r\nConnection: keep-alive\r\n")

    def resolve(self) -> None:
        """Look the host up once: under gevent every lookup is a trip through a thread pool, which would add
        jitter to each request's send time."""
        if self._addr is None:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            self._addr = infos[0][4][:2]

    def connect(self) -> socket.socket:
        self.resolve()
        assert self._addr is not None
        sock = socket.create_connection(self._addr, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl_ctx is not None:
            sock = self._ssl_ctx.wrap_socket(sock, server_hostname=self.host)
        sock.settimeout(self.timeout if self.io_timeout else None)
        return sock

    def acquire(self) -> tuple[socket.socket, bool]:
        now = time.monotonic()
        while self._idle:
            since, sock = self._idle.pop()
            if now - since <= self.max_idle_s:
                return sock, True
            _close(sock)
        return self.connect(), False

    def release(self, sock: socket.socket) -> None:
        self._idle.append((time.monotonic(), sock))

    def close(self) -> None:
        while self._idle:
            _close(self._idle.pop()[1])

    def request_bytes(self, body: bytes, headers: dict[str, str] | None = None) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        return (self._head + extra + f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


_RETRYABLE = (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED)


def stream_completion(endpoint: Endpoint, body: bytes, result: StreamResult, max_tokens: int | None = None,
                      headers: dict[str, str] | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
    """Send one streaming completion and fill ``result`` as it goes (so a caller that kills this greenlet still
    has the tokens received so far). Errors end up in ``result.error``; nothing is raised except GreenletExit."""
    req = endpoint.request_bytes(body, headers)
    if math.isnan(result.send_time):
        result.send_time = clock()
    result.last_activity = result.send_time
    sock = None
    try:
        for attempt in (0, 1):
            sock, reused = endpoint.acquire()
            try:
                sock.sendall(req)
                keep = _read_response(sock, result, max_tokens, clock)
                break
            except _StaleConnection:
                _close(sock)
                sock = None
                if attempt or not reused:
                    raise HTTPError("connection closed before the response") from None
        assert sock is not None
        if keep:
            endpoint.release(sock)
        else:
            _close(sock)
        sock = None
    except HTTPError as e:
        result.error = str(e)
    except socket.timeout:
        result.error = f"timeout: nothing received for {endpoint.timeout:g}s"
    except OSError as e:
        result.error = f"connection error: {e}"
    finally:
        if sock is not None:  # an error, or the greenlet was killed mid-stream
            _close(sock)
        if math.isnan(result.finish_time):
            result.finish_time = clock()


class _StaleConnection(Exception):
    pass


def _read_response(sock: socket.socket, result: StreamResult, max_tokens: int | None,
                   clock: Callable[[], float]) -> bool:
    """Read the response; returns whether the connection can be reused."""
    parser, sse = ResponseParser(), SSEParser()
    got_any = False
    error_body = bytearray()
    streaming = False
    saw_done = False
    while True:
        try:
            data = sock.recv(65536)
        except OSError as e:
            if not got_any and getattr(e, "errno", None) in _RETRYABLE:
                raise _StaleConnection() from None
            raise
        now = clock()
        result.last_activity = now
        if not data:
            if not got_any:
                raise _StaleConnection()
            if saw_done:
                break
            parser.eof()
            for ev in sse.close():
                saw_done |= _on_event(ev, now, result, max_tokens)
            break
        got_any = True
        body = parser.feed(data)
        if parser.headers_done and not result.http_status:
            result.http_status = parser.status
            ctype = parser.headers.get("content-type", "")
            streaming = parser.status == 200 and "text/event-stream" in ctype
        if streaming:
            for ev in sse.feed(body):
                saw_done |= _on_event(ev, now, result, max_tokens)
        elif parser.headers_done and len(error_body) < 4096:
            error_body += body
        if parser.complete or saw_done:
            break
    result.finish_time = clock()
    if not streaming:
        text = bytes(error_body[:300]).decode("utf-8", "replace").strip()
        if result.http_status == 200:
            result.error = f"not a stream (content-type {parser.headers.get('content-type', '?')!r}): {text}"
        else:
            result.error = f"HTTP {result.http_status}: {text}"
        return parser.complete and parser.keep_alive
    if not result.error:
        result.done = True
    return parser.complete and parser.keep_alive


_FAST_TOKEN = b'"finish_reason":null'
_TOKEN_IDS = re.compile(rb'[{,]"token_ids":\[([^\]]*)\]')  # not "prompt_token_ids"


def _add_tokens(result: StreamResult, now: float, count: int) -> None:
    if count <= 0:
        return
    result.token_times.extend([now] * count)
    result.events += 1
    result.multi_token_events += count > 1


def _listed_tokens(data: bytes) -> int | None:
    """How many tokens the event lists in ``token_ids`` (None: it lists none)."""
    m = _TOKEN_IDS.search(data)
    if m is None:
        return None
    ids = m.group(1).strip()
    return ids.count(b",") + 1 if ids else 0


def _on_event(data: bytes, now: float, result: StreamResult, max_tokens: int | None) -> bool:
    """Handle one SSE event; returns True for the final ``[DONE]``. Each event with a choice is one token,
    except an empty closing event (no text, a finish_reason) once all requested tokens have arrived."""
    if data == b"[DONE]":
        return True
    # fast path for the common event (a choice, not the last token, no error): no JSON parsing
    if _FAST_TOKEN in data and b'"choices":[{' in data and b'"error"' not in data and b'"usage":{' not in data:
        listed = _listed_tokens(data)
        _add_tokens(result, now, 1 if listed is None else listed)
        return False
    try:
        obj = json.loads(data)
    except ValueError:
        result.error = f"malformed event: {data[:100]!r}"
        return False
    if not isinstance(obj, dict):
        return False
    if "error" in obj:
        err = obj["error"]
        result.error = "server error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
        return False
    choices = obj.get("choices")
    if choices:
        c = choices[0]
        text = c.get("text")
        if text is None and isinstance(c.get("delta"), dict):  # chat completions
            text = c["delta"].get("content")
        if isinstance(c.get("token_ids"), list):
            _add_tokens(result, now, len(c["token_ids"]))
        elif text or not c.get("finish_reason") or max_tokens is None or len(result.token_times) < max_tokens:
            _add_tokens(result, now, 1)
    if obj.get("usage"):
        result.usage = obj["usage"]
    return False
