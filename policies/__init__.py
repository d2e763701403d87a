"""slotune's policies: declarative SLO / search-space / constraint policies (YAML) and their validation."""

from policies.policy import (OBJECTIVES, SAMPLERS, STARTS, CapacityPolicy, Choices, Constraint, Domain, FloatRange,
                             IntRange, KnobRange, MeasurementPolicy, Policy, PruningSpec, VerdictPolicy,
                             WorkloadSpec, default_policy_path, load_policy, parse_policy)
from policies.schema import PolicyError

__all__ = ["OBJECTIVES", "SAMPLERS", "STARTS", "CapacityPolicy", "Choices", "Constraint", "Domain", "FloatRange",
           "IntRange", "KnobRange", "MeasurementPolicy", "Policy", "PolicyError", "PruningSpec",
           "VerdictPolicy", "WorkloadSpec", "default_policy_path", "load_policy", "parse_policy"]
