"""slotune's policies: declarative SLO / search-space / constraint policies (YAML) and their validation."""

from policies.policy import (KNOB_TYPES, OBJECTIVES, SAMPLERS, STARTS, CapacityPolicy, Constraint, KnobRange,
                             MeasurementPolicy, Policy, PolicyError, PruningSpec, SLOTargets, VerdictPolicy,
                             WorkloadSpec, default_policy_path, load_policy, parse_policy)

__all__ = ["KNOB_TYPES", "OBJECTIVES", "SAMPLERS", "STARTS", "CapacityPolicy", "Constraint", "KnobRange",
           "MeasurementPolicy", "Policy", "PolicyError", "PruningSpec", "SLOTargets", "VerdictPolicy", "WorkloadSpec",
           "default_policy_path", "load_policy", "parse_policy"]
