"""A tiny OpenAI-compatible streaming server for testing the load generator's timing (not the engine).

It behaves like a continuous-batching engine with a fixed step time: a ticker fires every ``interval`` seconds
and every running request receives one token (one SSE event) per tick; a new request gets its first token at the
first tick after ``ttft`` has passed. It records, per request id (``X-Request-Id``), when it received the request
and when it wrote each token, and serves that on ``GET /stats`` so tests and benchmarks can check the client's
measurements against the server's own clock (same machine, same ``time.time()``).

Run: ``python tests/streaming_stub_server.py --port 0 --interval 0.02`` prints ``LISTENING <port>`` when ready.
Plain asyncio (no framework) so that the stub costs little CPU next to the generator it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


class Stream:
    __slots__ = ("writer", "rid", "remaining", "ready_at", "done", "times", "usage", "prompt_tokens", "total", "ids")

    def __init__(self, writer, rid, max_tokens, ready_at, prompt_tokens, usage, ids=False) -> None:
        self.ids = ids  # the request asked for each event's token_ids (vLLM's return_token_ids)
        self.writer = writer
        self.rid = rid
        self.remaining = max_tokens
        self.total = max_tokens
        self.ready_at = ready_at
        self.done = asyncio.get_running_loop().create_future()
        self.times: list[float] = []
        self.usage = usage
        self.prompt_tokens = prompt_tokens


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StubServer:
    def __init__(self, interval: float = 0.02, ttft: float = 0.0, record: bool = True,
                 tokens_per_event: int = 1) -> None:
        self.tokens_per_event = tokens_per_event  # > 1: several tokens in one event, as a server that falls behind
        self.interval = interval
        self.ttft = ttft
        self.record = record
        self.active: list[Stream] = []
        self.requests: dict[str, dict] = {}  # rid -> {"received": t, "tokens": [...], "prompt_tokens": n}
        self.completions = 0
        self.ticks = 0
        self.max_active = 0

    async def ticker(self) -> None:
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            next_t += self.interval
            delay = next_t - loop.time()
            if delay < -self.interval:  # fell behind by more than a step: don't burst to catch up
                next_t = loop.time()
            await asyncio.sleep(max(0.0, delay))
            self.ticks += 1
            now_loop = loop.time()
            if not self.active:
                continue
            still = []
            for s in self.active:
                if s.ready_at > now_loop:
                    still.append(s)
                    continue
                if s.writer.is_closing():
                    s.done.set_result(False) if not s.done.done() else None
                    continue
                k = min(self.tokens_per_event, s.remaining)
                if self.record:
                    s.times.extend([time.time()] * k)  # before the write: the client can't see a token before this
                s.remaining -= k
                last = s.remaining == 0
                ids = b',"token_ids":[%s]' % b",".join(b"7" for _ in range(k)) if s.ids else b""
                ev = (b'data: {"id":"cmpl-%s","object":"text_completion","model":"stub","choices":[{"index":0,'
                      b'"text":"%s","logprobs":null,"finish_reason":%s%s}]}\n\n'
                      % (s.rid.encode(), b" tok" * k, b'"length"' if last else b"null", ids))
                if last:
                    tail = b""
                    if s.usage:
                        tail = (b'data: {"id":"cmpl-%s","object":"text_completion","model":"stub","choices":[],'
                                b'"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n'
                                % (s.rid.encode(), s.prompt_tokens, s.total, s.prompt_tokens + s.total))
                    s.writer.write(_chunk(ev + tail + b"data: [DONE]\n\n") + b"0\r\n\r\n")
                else:
                    s.writer.write(_chunk(ev))
                if last:
                    s.done.set_result(True)
                else:
                    still.append(s)
            self.active = still

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                received = time.time()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = (lines[0].split(" ") + ["", ""])[:3]
                headers = {}
                for line in lines[1:]:
                    k, sep, v = line.partition(":")
                    if sep:
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                keep = headers.get("connection", "").lower() != "close"
                if method == "POST" and path.endswith("/completions"):
                    ok = await self.completion(writer, headers, body, received)
                    if not ok:
                        return
                elif method == "GET" and path.startswith("/stats"):
                    self.reply(writer, 200, self.stats(tokens="tokens=1" in path))
                elif method == "GET" and path == "/v1/models":
                    self.reply(writer, 200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
                elif method == "GET" and path == "/health":
                    self.reply(writer, 200, {"status": "ok"})
                else:
                    self.reply(writer, 404, {"error": {"message": f"no route {method} {path}"}})
                await writer.drain()
                if not keep:
                    return
        finally:
            writer.close()

    def reply(self, writer, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (status, len(data), data))

    async def completion(self, writer, headers, body: bytes, received: float) -> bool:
        try:
            req = json.loads(body)
            prompt = req["prompt"]
            n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
                raise ValueError("prompt token ids must be integers")
            max_tokens = int(req.get("max_tokens", 16))
            if max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
        except (ValueError, KeyError, TypeError) as e:
            self.reply(writer, 400, {"error": {"message": str(e)}})
            return True
        self.completions += 1
        rid = headers.get("x-request-id") or f"anon{self.completions}"
        usage = bool((req.get("stream_options") or {}).get("include_usage"))
        if not req.get("stream"):
            await asyncio.sleep(self.ttft + self.interval * max_tokens)
            self.reply(writer, 200, {"id": rid, "object": "text_completion",
                                     "choices": [{"index": 0, "text": " tok" * max_tokens, "finish_reason": "length"}],
                                     "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens}})
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        loop = asyncio.get_running_loop()
        s = Stream(writer, rid, max_tokens, loop.time() + self.ttft, n_prompt, usage, bool(req.get("return_token_ids")))
        if self.record:
            if rid in self.requests:
                self.requests[rid]["duplicates"] = self.requests[rid].get("duplicates", 0) + 1
            self.requests[rid] = {"received": received, "tokens": s.times, "prompt_tokens": n_prompt,
                                  "max_tokens": max_tokens}
        self.active.append(s)
        self.max_active = max(self.max_active, len(self.active))
        return await s.done

    def stats(self, tokens: bool) -> dict:
        reqs = self.requests if tokens else {k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                             for k, v in self.requests.items()}
        return {"completions": self.completions, "active": len(self.active), "max_active": self.max_active,
                "ticks": self.ticks, "interval": self.interval, "requests": reqs}


async def serve(host: str, port: int, interval: float, ttft: float, record: bool, tokens_per_event: int = 1) -> None:
    stub = StubServer(interval, ttft, record, tokens_per_event)
    server = await asyncio.start_server(stub.handle, host, port, backlog=4096, limit=1 << 24)
    asyncio.get_running_loop().create_task(stub.ticker())
    print(f"LISTENING {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--interval", type=float, default=0.02, help="seconds between tokens (the step time)")
    p.add_argument("--ttft", type=float, default=0.0, help="extra delay before the first token")
    p.add_argument("--no-record", action="store_true", help="don't keep per-token times")
    p.add_argument("--tokens-per-event", type=int, default=1, help="tokens sent in one event (a server behind)")
    a = p.parse_args(argv)
    try:
        asyncio.run(serve(a.host, a.port, a.interval, a.ttft, not a.no_record, a.tokens_per_event))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
