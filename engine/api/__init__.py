"""The HTTP front end of `slotune serve`: the OpenAI-compatible API (`protocol`, `generation`, `streaming`), the
read-only status routes, the admin API, and the plumbing they share (`http`, `body_limit`). Handlers only parse,
queue and write; all engine work happens in `EngineLoop`'s thread.

Status codes: 400 malformed or invalid request (with the reason; also a request with more prompts than the
server can ever take at once), 401 admin call without the right bearer token, 403 admin call on a server without
a token, 404 unknown model or path, 409 a confirmation of a generation not under lease, 413 body over
--max-body-bytes, 422 bad knob value (naming the knob), 429 more requests waiting beyond the free running slots
than --max-waiting-requests (with Retry-After), 500 the engine failed this request, 503 shutting down.
"""
