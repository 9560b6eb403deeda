"""A worker for the warm-start tests: reports its pid, parent, argv, env and torch's
presence, then exits with the status asked for, or waits for a signal."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
with open(out, "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv,
                        "env": os.environ.get("WARM_TEST"), "cwd": os.getcwd(),
                        "torch_preloaded": "torch" in sys.modules}) + "\n")
print(f"worker says hi on stdout ({mode})", flush=True)
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
if mode == "raise":
    raise RuntimeError("worker failed")
signal.signal(signal.SIGTERM, lambda *_: sys.exit(77))
while True:
    time.sleep(0.1)
