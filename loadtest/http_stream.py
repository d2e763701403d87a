"""Incremental parsers for a streamed HTTP/1.1 response and the server-sent events in its body.

Pure Python, no I/O: the caller feeds bytes as they arrive from the socket and timestamps them itself, so every
token's time is the time its bytes were received. Used by :mod:`loadtest.stream_client` (in the load process,
under gevent) and testable on its own.
"""

from __future__ import annotations


class HTTPError(Exception):
    pass


class ResponseParser:
    """Status line and headers, then the body framed by chunked transfer encoding, Content-Length, or the end of
    the connection. :meth:`feed` returns the body bytes decoded from the data given."""

    def __init__(self, head_request: bool = False) -> None:
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self._buf = bytearray()
        self._mode = ""  # "chunked" | "length" | "close"
        self._remaining = 0  # bytes left of the current chunk / of the Content-Length body
        self._chunk_state = "size"  # "size" | "data" | "crlf" | "trailers"
        self._head = head_request

    @property
    def keep_alive(self) -> bool:
        return self._mode != "close" and self.headers.get("connection", "").lower() != "close"

    def feed(self, data: bytes) -> bytes:
        if self.complete:
            return b""
        if not self.headers_done:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > 65536:
                    raise HTTPError("response headers too long")
                return b""
            self._parse_head(bytes(self._buf[:end]).decode("latin-1"))
            data = bytes(self._buf[end + 4:])
            self._buf.clear()
            if not self.headers_done:  # it was an interim 1xx response
                return self.feed(data)
            if self.complete:
                return b""
        if self._mode == "chunked":
            return self._chunked(data)
        if self._mode == "length":
            out = data[: self._remaining]
            self._remaining -= len(out)
            if self._remaining == 0:
                self.complete = True
            return out
        return data

    def eof(self) -> None:
        """The connection closed: fine for a close-delimited body, an error otherwise."""
        if self.complete:
            return
        if self.headers_done and self._mode == "close":
            self.complete = True
            return
        raise HTTPError("connection closed before the end of the response")

    def _parse_head(self, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise HTTPError(f"not an HTTP response: {lines[0][:80]!r}")
        try:
            self.status = int(parts[1])
        except ValueError:
            raise HTTPError(f"bad status line: {lines[0][:80]!r}") from None
        self.reason = parts[2] if len(parts) > 2 else ""
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if sep:
                self.headers[k.strip().lower()] = v.strip()
        self.headers_done = True
        if 100 <= self.status < 200:  # interim response: start over with the real one
            self.headers_done, self.headers = False, {}
            return
        if self._head or self.status in (204, 304):
            self.complete = True
        elif "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
        elif "content-length" in self.headers:
            self._mode, self._remaining = "length", int(self.headers["content-length"])
            self.complete = self._remaining == 0
        else:
            self._mode = "close"

    def _chunked(self, data: bytes) -> bytes:
        if self._buf:
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        out: list[bytes] = []
        pos, n = 0, len(data)
        while pos < n:
            state = self._chunk_state
            if state == "size":
                end = data.find(b"\r\n", pos)
                if end < 0:
                    break
                try:
                    size = int(data[pos:end].split(b";", 1)[0], 16)
                except ValueError:
                    raise HTTPError(f"bad chunk size line {data[pos:end][:40]!r}") from None
                pos = end + 2
                self._remaining = size
                self._chunk_state = "data" if size else "trailers"
            elif state == "data":
                take = min(self._remaining, n - pos)
                out.append(data[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._chunk_state = "crlf"
            elif state == "crlf":
                if n - pos < 2:
                    break
                pos += 2
                self._chunk_state = "size"
            else:  # trailers: lines until an empty one
                end = data.find(b"\r\n", pos)
                if end < 0:
                    break
                empty = end == pos
                pos = end + 2
                if empty:
                    self.complete = True
                    pos = n
                    break
        if pos < n:
            self._buf += data[pos:]
        return out[0] if len(out) == 1 else b"".join(out)


class SSEParser:
    """Server-sent events: returns the ``data`` of each complete event as bytes (multi-line data joined with
    ``\\n``). Lines end with ``\\n`` or ``\\r\\n``; comments and other fields are skipped."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, data: bytes) -> list[bytes]:
        if self._buf:
            data = self._buf + data
        elif not self._data and data.startswith(b"data: ") and data.find(b"\n") == len(data) - 2 \
                and data.endswith(b"\n\n"):
            return [data[6:-2]]  # the common case: exactly one single-line event
        events = []
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            line = data[start:nl]
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                v = line[5:]
                self._data.append(v[1:] if v.startswith(b" ") else v)
            # "event:", "id:", "retry:" and ":" comments carry nothing a completion stream needs
        self._buf = data[start:]
        return events

    def close(self) -> list[bytes]:
        """Events left when the stream ends without a final blank line."""
        return self.feed(b"\n\n") if (self._buf or self._data) else []
