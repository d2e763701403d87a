"""`slotune serve`'s command line: the YAML config file, the knob flags, errors before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.serve_cli import ConfigFileError, build_parser, load_config_file, main


def test_config_file_flat_or_with_a_knobs_section(tmp_path: Path) -> None:
    flat = tmp_path / "flat.yaml"
    flat.write_text("max_num_seqs: 32\nblock_size: 8\nchunk_size: null\npreemption_mode: swap\n")
    assert load_config_file(flat) == {"max_num_seqs": 32, "block_size": 8, "chunk_size": None,
                                      "preemption_mode": "swap"}
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text("slo:\n  tbt_p99_ms: 50\nknobs:\n  max_num_batched_tokens: 256\n  chunk_size: 64\n"
                     "vllm_flags: --max-num-seqs 32\n")
    assert load_config_file(tuned) == {"max_num_batched_tokens": 256, "chunk_size": 64}
    assert load_config_file(_write(tmp_path / "empty.yaml", "")) == {}


@pytest.mark.parametrize("text, reason", [
    ("max_num_seqs: 32\nwarp_speed: 9\n", "unknown knob"),
    ("- 1\n- 2\n", "mapping"),
    ("knobs: [1]\n", "mapping"),
    ("max_num_seqs: [\n", "cannot read"),
])
def test_bad_config_files(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(ConfigFileError, match=reason):
        load_config_file(_write(tmp_path / "bad.yaml", text))


def test_serve_refuses_a_bad_config_file_before_loading_the_model(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(_write(tmp_path / "bad.yaml", "warp_speed: 9\n"))]) == 2
    assert "warp_speed" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert main(["--max-waiting-requests", "-1"]) == 2
    assert main(["--step-buffer", "0"]) == 2


def test_every_knob_is_a_flag() -> None:
    parser = build_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    for knob in EngineConfig.knob_names():
        assert "--" + knob.replace("_", "-") in flags
    args = parser.parse_args(["--admin-token", "t", "--port", "9", "--block-size", "32", "--chunk-size", "none",
                              "--enable-prefix-caching", "false", "--step-log", "s.jsonl"])
    assert (args.admin_token, args.port, args.block_size, args.chunk_size, args.enable_prefix_caching,
            args.step_log, args.host) == ("t", 9, 32, None, False, "s.jsonl", "127.0.0.1")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
