"""chaos: break a training job on purpose and prove it came out right.

    scenario = chaos.load_scenario("scenarios/ci-smoke.toml")
    from relight.chaos.runner import run_scenario          # starts servers and processes
    result = run_scenario(scenario, "runs/chaos/ci-smoke")
    result.passed, result.report["invariants"]

`relight chaos run|check-script|report` is the command line (`chaos.cli`); `check-script`
(`chaos.check_script`) tells whether a user's training script meets the contract. The verifier
(`chaos.verifier.verify`) is a pure function of the evidence a run leaves: metrics,
checkpoint commits, injected faults, final states. See docs/chaos.md.
"""

from relight.chaos.faults import FaultEvent, FaultKind
from relight.chaos.scenario import Scenario, ScenarioError, load_scenario, parse_scenario
from relight.chaos.verifier import InvariantResult, RunEvidence, verify

__all__ = [
    "FaultEvent",
    "FaultKind",
    "InvariantResult",
    "RunEvidence",
    "Scenario",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
    "verify",
]
