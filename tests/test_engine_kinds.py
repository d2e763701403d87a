"""The engines tune can tune, without starting one: each one's command line from a config, vLLM's resolved
configuration read back, and the one reader of slotune's and vLLM's metrics."""

from __future__ import annotations

import math

from tuner.trials.engine_kinds import command_kind, slotune_kind, vllm_kind, vllm_resolved
from tuner.trials.engine_metrics import SLOTUNE_SERIES, VLLM_SERIES, histogram_buckets, queued

# the shape of vLLM 0.32.0's /server_info?config_format=json on a CPU (the fields tune reads, as it answered)
VLLM_CONFIG = {"model_config": {"max_model_len": 8192, "dtype": "torch.bfloat16"},
               "cache_config": {"block_size": 128, "enable_prefix_caching": True},
               "scheduler_config": {"max_num_seqs": 128, "max_num_batched_tokens": 2048,
                                    "long_prefill_token_threshold": 0}}

# vLLM labels every series with its model and engine index; two engines here, to show the sum
VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="SmolLM2-135M-Instruct"} 2.0
vllm:num_requests_running{engine="1",model_name="SmolLM2-135M-Instruct"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="SmolLM2-135M-Instruct"} 4.0
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="SmolLM2-135M-Instruct"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="SmolLM2-135M-Instruct"} 30.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="SmolLM2-135M-Instruct"} 31.0
vllm:inter_token_latency_seconds_bucket{engine="1",le="0.025",model_name="SmolLM2-135M-Instruct"} 1.0
vllm:inter_token_latency_seconds_bucket{engine="1",le="0.05",model_name="SmolLM2-135M-Instruct"} 2.0
vllm:inter_token_latency_seconds_bucket{engine="1",le="+Inf",model_name="SmolLM2-135M-Instruct"} 2.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="SmolLM2-135M-Instruct"} 31.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="SmolLM2-135M-Instruct"} 1.2
"""


def test_vllms_defaults_are_read_from_its_own_configuration() -> None:
    assert vllm_resolved(VLLM_CONFIG) == {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "chunk_size": None,
                                          "block_size": 128, "enable_prefix_caching": True, "max_model_len": 8192}
    assert vllm_resolved({"scheduler_config": {}}) == {}  # what the server does not say is not assumed


def test_a_knob_at_its_value_becomes_the_engines_flag() -> None:
    vllm = vllm_kind("/venv/bin/python", "/models/m", "m", ["--dtype", "bfloat16"])
    argv = vllm.command(8123, {"max_num_seqs": 6, "chunk_size": 16, "enable_prefix_caching": False})
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--model") + 1] == "/models/m"
    assert argv[-7:] == ["--dtype", "bfloat16", "--max-num-seqs", "6", "--long-prefill-token-threshold", "16",
                         "--no-enable-prefix-caching"]
    assert vllm.env["VLLM_SERVER_DEV_MODE"] == "1" and vllm.prefix_reset == "/reset_prefix_cache"
    assert vllm.unsupported(["max_num_seqs", "prefill_token_ratio"]) == ["prefill_token_ratio"]
    own = slotune_kind()  # slotune serve takes a bool knob as a value
    assert own.command(9, {"chunk_size": 16, "enable_prefix_caching": False})[-4:] == [
        "--chunk-size", "16", "--enable-prefix-caching", "false"]
    sglang = command_kind("python -m sglang.launch_server --model-path M --port {port} {knobs} --log-level warning",
                          {"max_num_seqs": "--max-running-requests"}, None)
    assert sglang.command(7, {"max_num_seqs": 8, "max_num_batched_tokens": 64}) == [
        "python", "-m", "sglang.launch_server", "--model-path", "M", "--port", "7", "--max-running-requests", "8",
        "--max-num-batched-tokens", "64", "--log-level", "warning"]


def test_one_reader_for_slotunes_and_vllms_series() -> None:
    assert histogram_buckets(VLLM_METRICS, VLLM_SERIES.inter_token_latency) == {0.025: 11.0, 0.05: 32.0,
                                                                               math.inf: 33.0}
    assert histogram_buckets(VLLM_METRICS, VLLM_SERIES.inter_token_latency,
                             {"engine": "1", "model_name": "SmolLM2-135M-Instruct"}) == {0.025: 1.0, 0.05: 2.0,
                                                                                          math.inf: 2.0}
    assert queued(VLLM_METRICS, VLLM_SERIES) == 7.0
    # a series the server lacks reads as not reported, never as zero
    assert queued(VLLM_METRICS, SLOTUNE_SERIES) is None
    assert histogram_buckets(VLLM_METRICS, SLOTUNE_SERIES.inter_token_latency) == {}


def test_a_failed_start_is_told_in_the_engines_own_words(tmp_path) -> None:
    """vLLM ends a failed start with a line pointing back at the cause, and code lines that name the error: the
    reason is the exception's own message."""
    from tuner.trials.restarted_engine import engine_reason

    log = tmp_path / "server-000.log"
    log.write_text(
        "$ python -m vllm.entrypoints.openai.api_server --block-size 16\n"
        "(Worker pid=9) ERROR 12-05 17:24:55 [multiproc_executor.py:1063]     raise ValueError(\n"
        "RuntimeError: Worker failed with error 'No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).', please "
        "check the stack trace above for the root cause\n"
        "    raise RuntimeError(\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert engine_reason(str(log)).startswith("RuntimeError: Worker failed with error 'No common block size for 16")
    log.write_text("$ srv\nlistening soon\n")
    assert engine_reason(str(log)) == "listening soon"
    # pydantic names the setting only on the line under its exception (vLLM's SchedulerConfig, as 0.32.0 logs it)
    log.write_text(
        "$ python -m vllm.entrypoints.openai.api_server --max-num-seqs 64 --max-num-batched-tokens 32\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig\n"
        "  Value error, max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64). "
        "[type=value_error, input_value=ArgsKwargs((), {'runner_t..., 'stream_interval': 1}), input_type=ArgsKwargs]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    assert engine_reason(str(log)) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig: Value error, "
        "max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64).")
