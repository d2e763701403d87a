"""`slotune serve`: the engine behind an OpenAI-compatible HTTP API with Prometheus metrics and live knob updates.

Knobs come from the defaults, then `--config FILE.yaml` (the file `tune` writes: a mapping of knobs, or a mapping
with a `knobs:` section), then the knob flags. The admin token comes from --admin-token or SLOTUNE_ADMIN_TOKEN;
without one, the /admin endpoints refuse every call.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from engine.cli import add_knob_arguments, knobs_from_args
from engine.config import ConfigError, EngineConfig


class ConfigFileError(ValueError):
    pass


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Knobs from a YAML file: either a flat mapping of knobs or a mapping with a `knobs` (or `engine`) section
    (other top-level keys, such as a tuner's report, are then ignored)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ConfigFileError(f"cannot read {path}: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a mapping of knobs")
    for section in ("knobs", "engine"):
        if section in data:
            data = data[section]
            if not isinstance(data, dict):
                raise ConfigFileError(f"{path}: `{section}` must be a mapping of knobs")
            break
    unknown = sorted(set(data) - set(EngineConfig.knob_names()))
    if unknown:
        raise ConfigFileError(f"{path}: unknown knob(s) {', '.join(map(str, unknown))}; known knobs: "
                              f"{', '.join(EngineConfig.knob_names())}")
    return dict(data)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotune serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--served-model-name", default=None, help="the model id of the API (default: the model's)")
    parser.add_argument("--config", default=None, metavar="FILE.yaml", help="knobs from a YAML file (tuned.yaml)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--admin-token", default=None,
                        help="bearer token of /admin (default: $SLOTUNE_ADMIN_TOKEN; none: admin disabled)")
    parser.add_argument("--step-log", default=None, metavar="FILE", help="append every step record as JSONL")
    parser.add_argument("--step-buffer", type=int, default=10_000, metavar="N",
                        help="step records kept for GET /debug/steps (default 10000; older ones are dropped, and "
                             "/debug/steps says how many a reader missed)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto (default): bfloat16 where the CPU has bf16 instructions and the kernels "
                             "are faster, float32 otherwise")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="seed of requests that do not give one")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests that may wait beyond the free slots of max_num_seqs; more get 429 with "
                             "Retry-After, and one request with more prompts than both together gets 400 (default 1024)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="larger request bodies get 413 (default 4 MiB)")
    parser.add_argument("--max-kv-memory-bytes", type=int, default=None,
                        help="largest KV pool a live update may create (default: half the free memory)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds in-flight requests get to finish; then each ends with "
                             "finish_reason \"abort\" (and [DONE] when streamed)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_knob_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (("--max-waiting-requests", args.max_waiting_requests),
                        ("--max-body-bytes", args.max_body_bytes)):
        if value < 0:
            print(f"slotune serve: {name} must be >= 0", file=sys.stderr)
            return 2
    if args.step_buffer < 1:
        print("slotune serve: --step-buffer must be >= 1", file=sys.stderr)
        return 2
    try:
        knobs = load_config_file(args.config) if args.config else {}
    except ConfigFileError as error:
        print(f"slotune serve: {error}", file=sys.stderr)
        return 2
    knobs.update(knobs_from_args(args))
    token = args.admin_token or os.environ.get("SLOTUNE_ADMIN_TOKEN") or None

    from engine.llm_engine import LLMEngine  # torch loads only once the arguments are known to be good
    from engine.server import create_server

    try:
        engine = LLMEngine(args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                           step_log=args.step_log, step_record_capacity=args.step_buffer, **knobs)
    except (ConfigError, ValueError) as error:
        print(f"slotune serve: {error}", file=sys.stderr)
        return 2
    server = create_server(engine, host=args.host, port=args.port, model_name=args.served_model_name,
                           admin_token=token, max_body_bytes=args.max_body_bytes,
                           max_waiting_requests=args.max_waiting_requests,
                           max_kv_memory_bytes=args.max_kv_memory_bytes, shutdown_timeout=args.shutdown_timeout,
                           log_level=args.log_level, access_log=args.access_log)
    logging.getLogger("slotune.server").info(
        "serving %s on http://%s:%d (admin %s), knobs %s", server.engine_loop.engine.model_name, args.host,
        args.port, "enabled" if token else "disabled", engine.config.knobs())
    try:
        server.run()
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
