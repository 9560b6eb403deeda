"""Storage faults inside training processes, handed over through the environment.

`storage.open_store` honours `RELIGHT_FAULT_PLAN` (see `storage.fault_env`): inline JSON
of `storage.FaultPlan` fields, or `@/path/file.json`, re-read when the file changes. The
chaos runner sets `RELIGHT_FAULT_PLAN=@<run dir>/fault-plan.json` for the processes it
starts and rewrites that file with `write_plan_file` to switch a fault on or off at any
moment of a run. This module only names, for the harness, the storage pieces it uses.
"""

from __future__ import annotations

from storage.fault_env import (
    ENV_VAR,
    FaultPlanError,
    ReloadingFaultyStore,
    plan_from_json,
    plan_to_json,
    wrap_store_from_env,
    write_plan_file,
)

__all__ = [
    "ENV_VAR",
    "FaultPlanError",
    "ReloadingFaultyStore",
    "plan_from_json",
    "plan_to_json",
    "wrap_store_from_env",
    "write_plan_file",
]
