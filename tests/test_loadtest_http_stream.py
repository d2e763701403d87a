"""The HTTP response and SSE parsers that time tokens, fed in arbitrary pieces."""

from __future__ import annotations

import json

import pytest

from loadtest.http_stream import HTTPError, ResponseParser, SSEParser
from loadtest.stream_client import StreamResult, _on_event


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


EVENTS = [json.dumps({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}).encode() for i in range(5)]
SSE = b"".join(b"data: %s\n\n" % e for e in EVENTS) + b"data: [DONE]\n\n"
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked(*[SSE[i:i + 37] for i in range(0, len(SSE), 37)]))


@pytest.mark.parametrize("piece", [1, 3, 17, 64, len(RESPONSE)])
def test_chunked_sse_in_any_pieces(piece):
    parser, sse = ResponseParser(), SSEParser()
    events = []
    for i in range(0, len(RESPONSE), piece):
        events += sse.feed(parser.feed(RESPONSE[i:i + piece]))
    assert parser.complete and parser.status == 200 and parser.keep_alive
    assert events == EVENTS + [b"[DONE]"]


def test_content_length_close_and_errors():
    p = ResponseParser()
    body = p.feed(b"HTTP/1.1 400 Bad\r\nContent-Length: 5\r\n\r\nhel") + p.feed(b"lo extra")
    assert body == b"hello" and p.complete and p.status == 400
    p = ResponseParser()
    assert p.feed(b"HTTP/1.0 200 OK\r\n\r\nabc") == b"abc" and not p.complete
    p.eof()
    assert p.complete and not p.keep_alive
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")
    with pytest.raises(HTTPError):
        p.eof()
    with pytest.raises(HTTPError):
        ResponseParser().feed(b"SSH-2.0-OpenSSH\r\n\r\n")


def test_sse_multiline_crlf_and_comments():
    sse = SSEParser()
    assert sse.feed(b": comment\r\nevent: x\r\ndata: a\r\ndata: b\r\n\r\ndata:c\n") == [b"a\nb"]
    assert sse.close() == [b"c"]
    assert SSEParser().feed(b"data: x\n\n") == [b"x"]  # the fast path
    two = SSEParser()
    assert two.feed(b"data: x\n\ndata: y\n") == [b"x"] and two.feed(b"\n") == [b"y"]


def test_token_counting_rules():
    r = StreamResult()

    def ev(text, fin=None, compact=False):
        obj = {"choices": [{"text": text, "finish_reason": fin}]}
        return json.dumps(obj, separators=(",", ":") if compact else None).encode()

    _on_event(ev("a", compact=True), 1.0, r, 3)  # fast path (vLLM-style compact JSON)
    _on_event(ev(""), 2.0, r, 3)  # a token that decodes to no text still counts
    _on_event(ev("c", "length"), 3.0, r, 3)
    _on_event(ev("", "length", compact=True), 4.0, r, 3)  # an empty closing event after all tokens: not a token
    _on_event(json.dumps({"choices": [], "usage": {"completion_tokens": 3}}).encode(), 5.0, r, 3)
    assert _on_event(b"[DONE]", 6.0, r, 3) is True
    assert r.token_times == [1.0, 2.0, 3.0] and r.usage == {"completion_tokens": 3} and not r.error
    _on_event(b'{"choices":[{"text":"x","finish_reason":null}],"error":{"message":"boom"}}', 7.0, r, 3)
    assert "boom" in r.error and len(r.token_times) == 3


def test_an_event_that_lists_several_tokens_counts_as_several_received_together():
    """vLLM puts several tokens in one event when its API process falls behind; with ``return_token_ids`` the event
    lists them: they count as that many tokens, their inner gaps zero, and the event as a multi-token event."""
    r = StreamResult()
    first = {"choices": [{"text": "a", "finish_reason": None, "prompt_token_ids": [1, 2, 3, 4, 5], "token_ids": [7]}]}
    _on_event(json.dumps(first, separators=(",", ":")).encode(), 1.0, r, 6)  # fast path; the prompt's ids ignored
    _on_event(b'{"choices":[{"text":"bcd","finish_reason":null,"prompt_token_ids":null,"token_ids":[8,9,10]}]}',
              2.0, r, 6)
    _on_event(json.dumps({"choices": [{"text": "ef", "finish_reason": "length", "token_ids": [11, 12]}]}).encode(),
              3.0, r, 6)  # the last event, parsed
    _on_event(b'{"choices":[{"text":"","finish_reason":"length","token_ids":[]}]}', 4.0, r, 6)  # no token in it
    _on_event(b'{"choices":[],"usage":{"completion_tokens":6}}', 5.0, r, 6)
    assert r.token_times == [1.0, 2.0, 2.0, 2.0, 3.0, 3.0]
    assert (r.events, r.multi_token_events) == (3, 2) and r.usage == {"completion_tokens": 6}
