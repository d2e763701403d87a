"""The names of the files a load test and a trial write into their folder, in one place: the load generator, the
tuner and the dashboard all read them from here. Standard library only (a leaf every layer may import)."""

from __future__ import annotations

RECORDS = "records.parquet"  # one row per request, every token's arrival time (loadtest/records.py)
RECORDS_CSV = "records.csv"  # the same as CSV, when asked for
SUMMARY = "summary.json"  # loadtest.summary.summarize over the window
STEPS = "steps.jsonl"  # the engine's step records of a trial's window, one per line
TRIAL = "trial.json"  # a trial's knobs, step statistics, feasibility and reason
PROGRESS = "progress.json"  # a running tune's measurement now and its budget left (the dashboard's live page)
