"""The controller's own Prometheus metrics (``slotune_controller_*``), served on ``--metrics-port``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

OUTCOMES = ("kept", "rolled_back", "advised", "no_move", "abandoned")


class ControllerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter("slotune_controller_decisions", "Decisions by outcome (kept, rolled_back, advised, "
                                 "no_move, abandoned).", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.decisions.labels(outcome=outcome)
        self.rollbacks = Counter("slotune_controller_rollbacks", "Canaries rolled back (by the controller or by "
                                 "the engine's lease).", registry=r)
        self.canary = Gauge("slotune_controller_canary_in_progress", "1 while a canary runs.", registry=r)
        self.attainment = Gauge("slotune_controller_last_attainment", "SLO attainment of the last trigger window "
                                "(share of finished requests; NaN before the first).", registry=r)
        self.attainment.set(float("nan"))
        self.source_up = Gauge("slotune_controller_source_up", "1 when the last scrape of the metrics source "
                               "answered.", registry=r)
        self.triggers = Counter("slotune_controller_triggers", "Triggers that fired, by kind.", ["kind"], registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def decided(self, outcome: str) -> None:
        self.decisions.labels(outcome=outcome).inc()
        if outcome in ("rolled_back", "abandoned"):
            self.rollbacks.inc()
