"""A worker that does no training: it records its start (pid, agent, rank, round) and
waits. On SIGTERM it takes `--save-s` seconds (an emergency checkpoint), writes
`{out}/saved-{pid}` and exits with the preemption status 76, as runtime.train does."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from types import FrameType

PREEMPTED_EXIT_CODE = 76  # runtime.preemption.PREEMPTED_EXIT_CODE, without importing torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--save-s", type=float, default=1.0)
    args = p.parse_args()

    def on_term(signum: int, frame: FrameType | None) -> None:
        time.sleep(args.save_s)
        with open(os.path.join(args.out, f"saved-{os.getpid()}"), "w") as f:
            f.write(str(time.time()))
        sys.exit(PREEMPTED_EXIT_CODE)

    signal.signal(signal.SIGTERM, on_term)
    line = json.dumps({"ev": "start", "t": time.time(), "pid": os.getpid(),
                       # Under warm starts the parent is the fork server.
                       "agent_pid": int(os.environ.get("RELIGHT_WARM_PARENT_PID",
                                                       os.getppid())),
                       "rank": int(os.environ["RANK"]),
                       "world": int(os.environ["WORLD_SIZE"]),
                       "round": os.environ.get("RELIGHT_RDZV_ROUND")})
    fd = os.open(os.path.join(args.out, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    while True:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
