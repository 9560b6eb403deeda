"""The testing surface of `storage`: fault injection for tests and the chaos harness.

Nothing here is part of the storage API a training job uses; import it only to break
storage on purpose:

- `FaultyStore(inner, FaultPlan(...))` wraps any store and fails, delays, corrupts or
  truncates its operations, deterministically per seed (`storage.faulty`);
- `corrupt_object(store, key, mode)` damages one stored object in place;
- the environment hook: a process whose environment sets `FAULT_PLAN_ENV`
  (``RELIGHT_FAULT_PLAN``, inline JSON of `FaultPlan` fields or ``@file``) gets every
  store `open_store` opens wrapped in a fault-injecting store following that plan. The
  chaos harness sets it for the training processes it starts and rewrites the file with
  `write_plan_file` to switch faults on and off (`storage.fault_env`). Unset, `open_store`
  returns the plain store.

The fault a `FaultyStore` raises, `InjectedFaultError`, stays in `storage`: it is a
`TransientStorageError` that any caller may meet while a test or chaos run is on.
"""

from relight.storage.fault_env import (
    FAULT_PLAN_ENV,
    FaultPlanError,
    ReloadingFaultyStore,
    plan_from_json,
    plan_to_json,
    wrap_store_from_env,
    write_plan_file,
)
from relight.storage.faulty import (
    DEFAULT_OPS,
    OPERATIONS,
    FaultLog,
    FaultPlan,
    FaultyStore,
    corrupt_object,
)

__all__ = [
    "DEFAULT_OPS",
    "FAULT_PLAN_ENV",
    "OPERATIONS",
    "FaultLog",
    "FaultPlan",
    "FaultPlanError",
    "FaultyStore",
    "ReloadingFaultyStore",
    "corrupt_object",
    "plan_from_json",
    "plan_to_json",
    "wrap_store_from_env",
    "write_plan_file",
]
