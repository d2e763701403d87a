"""slotune's policies: declarative SLO / search-space / constraint policies (YAML) and their validation."""

from policies.policy import (OBJECTIVES, SAMPLERS, STARTS, Constraint, KnobRange, Policy, PruningSpec, SLOTargets,
                             WorkloadSpec, default_policy_path, load_policy, parse_policy)
from policies.schema import PolicyError

__all__ = ["OBJECTIVES", "SAMPLERS", "STARTS", "Constraint", "KnobRange", "Policy", "PolicyError", "PruningSpec",
           "SLOTargets", "WorkloadSpec", "default_policy_path", "load_policy", "parse_policy"]
