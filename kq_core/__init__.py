"""The contract of ``route_shed``, free of any array framework but NumPy.

The floor every other package of kq stands on: the result types and constants
(:mod:`kq_core.contract`), the argument checks (:mod:`kq_core.validate`), the
NumPy oracle that defines the op (:mod:`kq_core.oracle`), the golden vectors
of ``shared/spec.json`` (:mod:`kq_core.spec`), input generators
(:mod:`kq_core.inputs`), the bit-for-bit comparison (:mod:`kq_core.compare`) and the rules
for a routed expert that is not resident (:mod:`kq_core.rules`).
"""

from kq_core.contract import MAX_TOP_K, RouteShedResult, TopkRouteShedResult
from kq_core.oracle import route_shed_oracle, topk_route_shed_oracle
from kq_core.rules import DEFAULT_RULE, RULES, Rule, check_rule
from kq_core.validate import (RouteShedArgumentError, RouteShedDtypeError, RouteShedInputError, check_route_shed_args,
                              check_topk_route_shed_args, validate)

__all__ = ["DEFAULT_RULE", "MAX_TOP_K", "RULES", "RouteShedArgumentError", "RouteShedDtypeError", "RouteShedInputError",
           "RouteShedResult", "Rule", "TopkRouteShedResult", "check_route_shed_args", "check_rule",
           "check_topk_route_shed_args", "route_shed_oracle", "topk_route_shed_oracle", "validate"]
