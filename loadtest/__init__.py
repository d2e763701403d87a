"""slotune's load generator (docs/architecture.md; durations are parsed by ``slotune.units``).

Pure modules, importable anywhere (the tuner uses them; no locust, no gevent, never the engine):

- ``workloads``  mixed / prefix / Azure CSV / Mooncake JSONL workloads, length scale, clipping
- ``tokens``     prompt token ids of exact lengths, shared exactly where a workload shares prefixes
- ``arrivals``   trace timestamps, Poisson, Gamma with burstiness, rate ramp, constant
- ``config``     the options (flags, SLOTUNE_* environment variables, web UI fields) -> LoadConfig
- ``schedule``   workload + arrivals -> every request with its intended send time; split among processes
- ``records``    one record per request, written as parquet or CSV
- ``summary``    the summary (TTFT, TBT, attainment, goodput, send lag) computed from the records
- ``http_stream``, ``stream_client``  one streamed completion, with the arrival time of every token
- ``runner``, ``cli``  ``slotune loadtest``: Locust in processes of its own, progress, the summary table

Load-process modules (gevent; run inside Locust only): ``openloop`` (the open-loop dispatcher) and
``locustfile`` (``locust -f loadtest/locustfile.py``: Locust wiring, master/worker plan and records).
"""
