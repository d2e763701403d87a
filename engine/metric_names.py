"""The names of the engine's Prometheus series: the engine exports under them (`engine.metrics`) and every reader
(the tuner's trials, the controller, the dashboards) reads by them. Torch-free, like `engine.knobs`.

A counter is exported by prometheus_client with a ``_total`` suffix, a histogram as ``_bucket``, ``_sum`` and
``_count`` series: :func:`total`, :func:`bucket`, :func:`hist_sum` and :func:`hist_count` spell them.
"""

from __future__ import annotations

# histograms, seconds
TTFT = "slotune_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "slotune_inter_token_latency_seconds"
E2E = "slotune_e2e_request_latency_seconds"
REQUEST_ITL_P99 = "slotune_request_itl_p99_seconds"  # one finished request's own p99 gap
QUEUE_TIME = "slotune_request_queue_time_seconds"
STEP_DURATION = "slotune_step_duration_seconds"
# histograms, tokens
REQUEST_PROMPT_TOKENS = "slotune_request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "slotune_request_generation_tokens"
STEP_TOKENS = "slotune_step_tokens"
# gauges
RUNNING = "slotune_num_requests_running"
WAITING = "slotune_num_requests_waiting"
PREEMPTED = "slotune_num_requests_preempted"
KV_CACHE_USAGE = "slotune_kv_cache_usage_ratio"
KV_BLOCKS_USED = "slotune_kv_cache_blocks_used"
KV_BLOCKS_FREE = "slotune_kv_cache_blocks_free"
CONFIG_GENERATION = "slotune_config_generation"
KNOB = "slotune_knob"  # labelled by knob name
LEASE_PENDING = "slotune_config_lease_pending"
MAX_MODEL_LEN = "slotune_max_model_len"
# counters (exported with _total)
PREEMPTIONS = "slotune_preemptions"
PROMPT_TOKENS = "slotune_prompt_tokens"
GENERATION_TOKENS = "slotune_generation_tokens"
PREFIX_QUERIES = "slotune_prefix_cache_queries"
PREFIX_HITS = "slotune_prefix_cache_hits"
REQUEST_SUCCESS = "slotune_request_success"  # labelled by finished_reason
LEASE_REVERTS = "slotune_config_lease_reverts"
CONFIG_UPDATES = "slotune_config_updates"
HTTP_RESPONSES = "slotune_http_responses"

QUEUES = (RUNNING, WAITING, PREEMPTED)  # a request in the engine is in one of these


def total(counter: str) -> str:
    return counter + "_total"


def bucket(histogram: str) -> str:
    return histogram + "_bucket"


def hist_sum(histogram: str) -> str:
    return histogram + "_sum"


def hist_count(histogram: str) -> str:
    return histogram + "_count"
