"""What the steps of one ``tune`` run share, whichever objective it runs: built once by the session
(tuner/commands/session.py) and handed to the objective's runner (tuner/commands/capacity_run.py or
tuner/commands/goodput_run.py), which never reads the session itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from policies import Policy
from tuner.measure.measurement import Draws
from tuner.trials.engine_handle import EngineHandle
from tuner.trials.engine_kinds import ServerKind
from tuner.trials.restarted_engine import RestartedEngine


@dataclass
class RunContext:
    policy: Policy
    study_name: str
    storage_url: str  # where the study is kept, as tuned.yaml records it
    out: Path  # tuned.yaml; the report and the vLLM flags go beside it
    trials_dir: Path  # the trials' folders
    started: float  # time.monotonic() when the run started (its time budget counts from here)
    draws: Draws  # the run's arrival draws, from its seed
    design_seed: int  # the screen's space-filling design (tuner/search/design.py)
    screen: int | None  # --screen N: configs the simulator screens (None: the objective's own number)
    apply: bool  # --apply: leave the tuned config in the engine at --engine-url
    handle: EngineHandle | None  # the engine's API (the running server's, with a server per configuration)
    kind: ServerKind | None = None  # --engine vllm|command: the server started per configuration
    restarted: RestartedEngine | None = None
    applied: bool = False  # set once --apply left the tuned config in the engine

    @property
    def engine_name(self) -> str:
        return self.kind.name if self.kind is not None else "slotune"

    def slo_text(self) -> str:
        return self.policy.slo.words()
