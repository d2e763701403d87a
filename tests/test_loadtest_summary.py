"""The summary computed from records: hand-made records with answers worked out by hand."""

from __future__ import annotations

import math

import pytest

from loadtest.records import RequestRecord, read_records, to_frame, write_records
from slotune.slo import SLO
from loadtest.summary import attains, format_summary_table, percentile, request_tbt_p99, summarize

BASE = 1_000_000.0


def rec(i, status="ok", ttft=None, gaps=(), lag=None, out=None):
    """Request i, intended at BASE + i, first token ttft after that, then tokens after the given gaps."""
    intended = BASE + i
    times = []
    if ttft is not None:
        times = [intended + ttft]
        for g in gaps:
            times.append(times[-1] + g)
    return RequestRecord(
        index=i, id=str(i), scheduled_at=float(i), intended_send_time=intended,
        actual_send_time=intended + lag if lag is not None else math.nan,
        prompt_tokens=10, max_tokens=out if out is not None else len(times), output_tokens=len(times),
        ttft=times[0] - intended if times else math.nan, token_times=times,
        finish_time=times[-1] if times else math.nan, status=status,
    )


@pytest.fixture
def records():
    return [
        rec(0, ttft=0.1, gaps=(0.02, 0.02, 0.02), lag=0.001),  # ok, own TBT p99 0.02
        rec(1, ttft=0.5, gaps=(0.03, 0.10), lag=0.002),  # ok, own p99 0.03 + 0.99 * 0.07 = 0.0993
        rec(2, ttft=0.2, lag=0.003),  # ok, one token: no gaps
        rec(3, "error", ttft=0.05, gaps=(0.01,), lag=0.004, out=5),  # failed mid-stream
        rec(4, "unfinished", ttft=0.3, gaps=(0.04,), lag=0.005, out=5),  # cut at the end of the run
        rec(5, "not_sent", out=5),  # never sent
    ]


def test_percentile_interpolates_linearly():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert percentile([10.0], 99) == 10.0
    assert percentile([], 50) is None


def test_counts_rates_and_percentiles(records):
    s = summarize(records, SLO(tbt_p99=0.05), duration_s=10.0)
    assert (s["requests"], s["completed"], s["failed"], s["unfinished"], s["not_sent"]) == (6, 3, 1, 1, 1)
    assert s["duration_s"] == 10.0
    assert s["offered_rps"] == pytest.approx(0.6)
    assert s["throughput_rps"] == pytest.approx(0.3)
    assert s["output_tokens_per_s"] == pytest.approx((4 + 3 + 1) / 10)
    # TTFT over the five requests that got a token: 0.05 0.1 0.2 0.3 0.5
    assert s["ttft_p50"] == pytest.approx(0.2)
    assert s["ttft_p90"] == pytest.approx(0.42)
    assert s["ttft_p99"] == pytest.approx(0.492)
    # pooled gaps of all requests, failed and unfinished included: .01 .02 .02 .02 .03 .04 .10
    assert s["tbt_gaps"] == 7
    assert s["tbt_p50"] == pytest.approx(0.02)
    assert s["tbt_p90"] == pytest.approx(0.064)
    assert s["tbt_p99"] == pytest.approx(0.0964)
    assert s["tbt_max"] == pytest.approx(0.10)
    # end to end, completed requests: 0.16 0.63 0.2
    assert s["e2e_p50"] == pytest.approx(0.2)
    # send lag of the five sent ones: 1..5 ms
    assert s["send_lag_p50"] == pytest.approx(0.003)
    assert s["send_lag_p99"] == pytest.approx(0.00496)
    assert s["send_lag_max"] == pytest.approx(0.005)
    assert s["generator_kept_up"] is False  # one request was due and never sent
    assert any("never sent" in w for w in s["warnings"])


def test_pooled_vs_per_request_tbt(records):
    # request 1's own p99 (0.0993) is above its pooled counterpart (0.0964): one slow gap sinks one request
    assert request_tbt_p99(records[1]) == pytest.approx(0.0993)
    assert request_tbt_p99(records[0]) == pytest.approx(0.02)
    assert request_tbt_p99(records[2]) == 0.0  # no gaps
    # a target between the two: the pooled p99 meets it, request 1 does not attain it
    s = summarize(records, SLO(tbt_p99=0.098), duration_s=10.0)
    assert s["tbt_p99"] < 0.098
    assert not attains(records[1], SLO(tbt_p99=0.098))
    assert s["attaining"] == 2  # requests 0 and 2


def test_attainment_with_and_without_ttft_target(records):
    s = summarize(records, SLO(tbt_p99=0.05), duration_s=10.0)
    assert s["attaining"] == 2  # 0 and 2; 1 misses TBT; 3, 4, 5 did not complete
    assert s["attainment"] == pytest.approx(2 / 6)
    assert s["attainment_without_ttft"] == pytest.approx(2 / 6)
    assert s["goodput_rps"] == pytest.approx(0.2)
    assert s["goodput_tokens_per_s"] == pytest.approx((4 + 1) / 10)

    s = summarize(records, SLO(tbt_p99=0.05, ttft_p99=0.15), duration_s=10.0)
    assert s["attaining"] == 1  # request 2's TTFT 0.2 > 0.15
    assert s["attainment"] == pytest.approx(1 / 6)
    assert s["attainment_without_ttft"] == pytest.approx(2 / 6)
    assert s["goodput_rps"] == pytest.approx(0.1)
    assert s["goodput_tokens_per_s"] == pytest.approx(0.4)
    assert s["slo"] == {"tbt_p99": 0.05, "ttft_p99": 0.15, "e2e_p99": None}


def test_failed_and_unfinished_never_attain(records):
    loose = SLO(tbt_p99=10.0, ttft_p99=10.0, e2e_p99=10.0)
    for r in records[3:]:
        assert not attains(r, loose)
    s = summarize(records, loose, duration_s=10.0)
    assert s["attaining"] == 3
    assert s["attainment"] == pytest.approx(0.5)
    # no targets at all: completing is attaining
    assert summarize(records, None, duration_s=10.0)["attainment"] == pytest.approx(0.5)


def test_e2e_target(records):
    s = summarize(records, SLO(e2e_p99=0.5), duration_s=10.0)
    assert s["attaining"] == 2  # request 1 took 0.63 s end to end


def test_window_and_inputs(records, tmp_path):
    s = summarize(records, SLO(tbt_p99=0.05), window=(1.0, 4.0))
    assert s["requests"] == 3 and s["duration_s"] == 3.0 and s["attaining"] == 1  # 1, 2, 3: only 2 attains
    direct = summarize(records, SLO(tbt_p99=0.05), duration_s=10.0)
    assert summarize(to_frame(records), SLO(tbt_p99=0.05), duration_s=10.0) == direct
    for ext in ("parquet", "csv"):
        path = write_records(str(tmp_path / f"records.{ext}"), records)
        assert summarize(path, SLO(tbt_p99=0.05), duration_s=10.0) == direct
        back = read_records(path)
        assert [r.token_times for r in back] == [r.token_times for r in records]
        assert [r.status for r in back] == [r.status for r in records]


def test_duration_defaults_and_json_ready(records):
    s = summarize(records, meta={"schedule_duration_s": 12.0, "workload": "mixed"})
    assert s["duration_s"] == 12.0 and s["workload"] == "mixed"
    empty = summarize([], SLO(tbt_p99=0.05), duration_s=5.0)
    assert empty["requests"] == 0 and empty["attainment"] is None and empty["tbt_p99"] is None
    import json

    json.dumps(s, allow_nan=False)
    json.dumps(empty, allow_nan=False)


def test_lag_warning_and_table(records):
    late = [rec(i, ttft=0.1, gaps=(0.02,), lag=0.05) for i in range(5)]
    s = summarize(late, SLO(tbt_p99=0.05), duration_s=5.0, lag_warn=0.01)
    assert s["generator_kept_up"] is False
    assert any("could not keep up" in w for w in s["warnings"])
    table = format_summary_table(summarize(records, SLO(0.05, 2.0), duration_s=10.0))
    assert "attainment" in table and "33.3%" in table and "tbt_p99 <= 50ms" in table
