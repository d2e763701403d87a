"""The engines ``tune`` can tune, and how each is started, read and reset.

- ``slotune``: slotune's own engine; its knobs change live (``PATCH /admin/config``), one server for the whole run.
- ``vllm``: a vLLM OpenAI-compatible server per configuration, the knobs passed as its flags (upstream vLLM changes
  none of them on a running server). Its development routes (``VLLM_SERVER_DEV_MODE=1``) give the configuration it
  resolved (``/server_info``) and drop its prefix cache (``/reset_prefix_cache``).
- ``command``: any OpenAI-compatible server from a command template (``{port}``, ``{model}`` and ``{knobs}`` are
  filled in), the knobs passed as flags named by the template's flag map.

The knob-to-flag map and what each engine accepts live in the knob schema (``engine/knobs.py``); this module turns a
config into a command line and reads back what the server resolved.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from engine.knobs import KNOB_BY_NAME, engine_flag, flag_words
from tuner.trials.engine_metrics import SLOTUNE_SERIES, VLLM_SERIES, EngineSeries

ENGINES = ("slotune", "vllm", "command")
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class ServerKind:
    """How one kind of server is started with a config and read back."""

    name: str  # one of ENGINES
    argv: tuple[str, ...]  # the command, ``{port}``, ``{model}`` and ``{knobs}`` to be filled in
    flags: dict[str, str]  # knob -> its command-line flag on this engine
    series: EngineSeries = SLOTUNE_SERIES
    env: dict[str, str] = field(default_factory=dict)
    negate_bools: bool = True  # a bool knob as --flag / --no-flag (vLLM) or as --flag true|false (slotune serve)
    prefix_reset: str | None = None  # POST route that drops the prefix cache (None: the server has none)
    model: str | None = None

    def command(self, port: int, knobs: dict[str, Any]) -> list[str]:
        """The server's argv with ``knobs`` as flags (a knob at its engine default is left to the engine)."""
        flags = [part for name, value in knobs.items() for part in self.flag_args(name, value)]
        out: list[str] = []
        for arg in self.argv:
            if arg == "{knobs}":
                out += flags
            else:
                out.append(arg.replace("{port}", str(port)).replace("{model}", self.model or ""))
        if "{knobs}" not in self.argv:
            out += flags
        return out

    def flag_args(self, name: str, value: Any) -> list[str]:
        """``--flag value`` of one knob on this engine (a bool as ``--flag`` / ``--no-flag``, vLLM's style)."""
        return flag_words(self.flags[name], value, self.negate_bools)

    def unsupported(self, names: list[str]) -> list[str]:
        """The knobs among ``names`` this engine has no flag for."""
        return [n for n in names if n not in self.flags]


def slotune_kind(model: str | None = None, python: str = sys.executable) -> ServerKind:
    """slotune's own server started per configuration (the restart path, beside its live changes)."""
    argv = [python, "-m", "slotune.cli", "serve", "--port", "{port}", "--log-level", "warning",
            "--max-waiting-requests", "100000"] + (["--model", "{model}"] if model else []) + ["{knobs}"]
    return ServerKind("slotune", tuple(argv), {k.name: k.flag for k in KNOB_BY_NAME.values()}, model=model,
                      negate_bools=False)


def vllm_kind(python: str, model: str, served_name: str, extra: list[str]) -> ServerKind:
    """vLLM's OpenAI-compatible server from ``python``'s environment, serving the model folder ``model``."""
    argv = [python, "-m", VLLM_SERVER_MODULE, "--model", "{model}", "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", "{port}", "--disable-uvicorn-access-log", *extra, "{knobs}"]
    flags = {k.name: f for k in KNOB_BY_NAME.values() if (f := engine_flag(k, "vllm")) is not None}
    # the development routes: the resolved configuration and the prefix-cache reset (the KV pool is the engine's own
    # default unless the caller's environment sets VLLM_CPU_KVCACHE_SPACE)
    env = {"VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return ServerKind("vllm", tuple(argv), flags, VLLM_SERIES, env, prefix_reset="/reset_prefix_cache", model=model)


def command_kind(template: str, flag_map: dict[str, str], model: str | None) -> ServerKind:
    """Any OpenAI-compatible server: ``template`` (shell words; ``{port}`` required), the knob flags from the knob
    schema's vLLM names, overridden by ``flag_map``."""
    argv = tuple(shlex.split(template))
    if not any("{port}" in a for a in argv):
        raise ValueError("the engine command must say where to listen: put {port} in it")
    flags = {k.name: f for k in KNOB_BY_NAME.values() if (f := engine_flag(k, "vllm")) is not None}
    for name, flag in flag_map.items():
        if name not in KNOB_BY_NAME:
            raise ValueError(f"--knob-flag {name}={flag}: unknown knob; known knobs: {', '.join(KNOB_BY_NAME)}")
        if not flag.startswith("-"):
            raise ValueError(f"--knob-flag {name}={flag}: a flag starts with '-'")
        flags[name] = flag
    return ServerKind("command", argv, flags, model=model)


# --------------------------------------------------------------------------------------- what a server resolved

_VLLM_FIELDS = {  # knob -> where vLLM's configuration (``/server_info?config_format=json``) holds it
    "max_num_seqs": ("scheduler_config", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
    "chunk_size": ("scheduler_config", "long_prefill_token_threshold"),
    "block_size": ("cache_config", "block_size"),
    "enable_prefix_caching": ("cache_config", "enable_prefix_caching"),
    "max_model_len": ("model_config", "max_model_len"),
}


def vllm_resolved(config: dict[str, Any]) -> dict[str, Any]:
    """The knobs as vLLM resolved them, from its configuration as JSON (``/server_info``'s ``vllm_config``)."""
    out: dict[str, Any] = {}
    for knob_name, (section, field_name) in _VLLM_FIELDS.items():
        fields = config.get(section) or {}
        if field_name not in fields:
            continue  # not said: not assumed
        value = fields[field_name]
        if knob_name == "chunk_size" and value == 0:
            value = None  # vLLM's 0: no threshold, a prefill may take the whole step budget
        knob = KNOB_BY_NAME[knob_name]
        if (value is None and knob.optional) or isinstance(value, knob.type):
            out[knob_name] = value
    return out
