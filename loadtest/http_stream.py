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
        self._buf += data
        if not self.headers_done:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > 65536:
                    raise HTTPError("response headers too long")
                return b""
            self._parse_head(bytes(self._buf[:end]).decode("latin-1"))
            del self._buf[: end + 4]
        if self._mode == "chunked":
            return self._chunked()
        if self._mode == "length":
            n = min(self._remaining, len(self._buf))
            out = bytes(self._buf[:n])
            del self._buf[:n]
            self._remaining -= n
            if self._remaining == 0:
                self.complete = True
            return out
        out = bytes(self._buf)
        self._buf.clear()
        return out

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

    def _chunked(self) -> bytes:
        out = bytearray()
        buf = self._buf
        while True:
            if self._chunk_state == "size":
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                try:
                    size = int(bytes(buf[:end]).split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise HTTPError(f"bad chunk size line {bytes(buf[:end])[:40]!r}") from None
                del buf[: end + 2]
                self._remaining = size
                self._chunk_state = "data" if size else "trailers"
            elif self._chunk_state == "data":
                n = min(self._remaining, len(buf))
                if n == 0:
                    break
                out += buf[:n]
                del buf[:n]
                self._remaining -= n
                if self._remaining == 0:
                    self._chunk_state = "crlf"
            elif self._chunk_state == "crlf":
                if len(buf) < 2:
                    break
                del buf[:2]
                self._chunk_state = "size"
            else:  # trailers: lines until an empty one
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                del buf[: end + 2]
                if end == 0:
                    self.complete = True
                    break
        return bytes(out)


class SSEParser:
    """Server-sent events: returns the ``data`` of each complete event (multi-line data joined with ``\\n``).
    Lines end with ``\\n`` or ``\\r\\n``; comments and other fields are skipped."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        events = []
        buf = self._buf + data if self._buf else data
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                v = line[5:]
                self._data.append((v[1:] if v.startswith(b" ") else v).decode("utf-8", "replace"))
            # "event:", "id:", "retry:" and ":" comments carry nothing a completion stream needs
        self._buf = buf[start:]
        return events

    def close(self) -> list[str]:
        """Events left when the stream ends without a final blank line."""
        events = self.feed(b"\n\n") if (self._buf or self._data) else []
        return events
