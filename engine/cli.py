"""`slotune generate`: an offline generation run with a per-request timing table; and the knob flags that every
engine-starting command shares."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from engine.config import ConfigError
from engine.knobs import KNOB_NAMES, KNOBS, Knob
from engine.sampling_params import RequestOutput, SamplingParams

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for writing clear documentation.",
    "Explain in two sentences why the sky is blue.",
    "Summarize the plot of Romeo and Juliet.",
    "What is continuous batching in LLM inference?",
]


def _flag_type(knob: Knob) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return knob.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = knob.type.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def add_knob_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per engine knob (`--max-num-seqs 32`, ...), all defaulting to "leave as configured"."""
    group = parser.add_argument_group("engine knobs")
    for knob in KNOBS:
        unit = f", in {knob.unit}" if knob.unit else ""
        default = "none" if knob.default is None else knob.default
        # SUPPRESS: an absent flag leaves the knob as configured, while `--chunk-size none` sets it to None.
        group.add_argument(knob.flag, dest=knob.name, type=_flag_type(knob), default=argparse.SUPPRESS,
                           choices=knob.choices, help=f"{knob.help}{unit}; default: {default}")


def knobs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in KNOB_NAMES if hasattr(args, name)}


def format_timing_table(outputs: list[RequestOutput]) -> str:
    header = f"{'request':<8} {'prompt':>6} {'output':>6} {'ttft_ms':>8} {'e2e_s':>7} {'tok/s':>7}  finish"
    lines = [header, "-" * len(header)]
    for out in outputs:
        ttft = (out.first_token_time - out.arrival_time) * 1000 if out.first_token_time else float("nan")
        e2e = (out.finish_time or out.arrival_time) - out.arrival_time
        decode_s = (out.finish_time or 0) - (out.first_token_time or 0)
        rate = (len(out.token_ids) - 1) / decode_s if decode_s > 0 and len(out.token_ids) > 1 else float("nan")
        lines.append(f"{out.request_id:<8} {len(out.prompt_token_ids):>6} {len(out.token_ids):>6} {ttft:>8.1f} "
                     f"{e2e:>7.2f} {rate:>7.1f}  {out.finish_reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slotune generate", description=__doc__)
    parser.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto (default): bfloat16 where the CPU has bf16 instructions and the kernels "
                             "are faster, float32 otherwise")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: six questions")
    parser.add_argument("--raw", action="store_true", help="send prompts as plain text, not through the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    add_knob_arguments(parser)
    args = parser.parse_args(argv)

    from engine.llm import LLM  # torch loads only once the arguments are known to be good

    try:
        llm = LLM(args.model, dtype=args.dtype, **knobs_from_args(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except (ConfigError, ValueError) as error:
        print(f"slotune generate: {error}", file=sys.stderr)
        return 2
    prompts = args.prompt or DEFAULT_PROMPTS
    print(f"model {llm.engine.model_name}, knobs {llm.config.knobs()}", file=sys.stderr)
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"--- {out.request_id}: {prompt}\n{out.text.strip()}\n")
    print(format_timing_table(outputs))
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {total} output tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")
    return 0
