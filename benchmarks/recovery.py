"""Recovery benchmark: kill one worker, time until the job completes a step again.

    python -m relight.benchmarks.recovery --json OUT.json [--state-mib 256] [--kills 3]

Two arms run the same job side by side in one invocation (the same state,
the same step, the same kill schedule):

- `baseline`: torchrun, c10d rendezvous, `--max-restarts`, DCP `async_save` every
  `--ckpt-every` steps through DCP's fsspec writer (s3fs), restore with `dcp.load`
  through its fsspec reader from the newest step that has a `.metadata`; the workers
  get a fresh store each round (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, torch's opt-out;
  `--baseline-shared-store` keeps torchrun's default shared store, under which the
  restarted groups failed in `init_process_group` on this machine);
- `relight`: torchrun with `--rdzv-backend=relight-etcd` on a real etcd started here,
  checkpoints with Relight's `ckpt.CheckpointManager` (async), restore with
  `CheckpointManager.restore`.

Both arms keep their checkpoints on one S3 server started here (SeaweedFS,
`chaos.s3_server`, on loopback), each job and arm under its own prefix.

The job: a float32 state of `--state-mib` MiB, sharded over the ranks as a DTensor
(Shard(0) on a 1-D CPU mesh), gloo. A step adds to the local shard and all-reduces a
scalar. One worker (rank 1) is SIGKILLed `--kills` times per job (`--jobs` fresh jobs per
arm), each time once the running generation has completed `--ckpt-every + 2` steps and
one of its checkpoints is done on every rank, so every recovery restores one
(`resumed_step` in the breakdown).
Recovery = kill -> first completed step of the restarted group. The breakdown comes
from events the workers (and, for relight, the rendezvous) write with wall-clock times:

- `to_process_s`: kill -> first line of the new worker (detection, rendezvous, spawn);
  for relight also `detect_s` (kill -> next_rendezvous call) and `rendezvous_s`;
- `import_s`, `init_pg_s`, `restore_s`, `first_step_s`: the new worker's phases
  (latest rank for each).

A kill whose group does not step again within `--recovery-timeout` (or whose agent
gives up) counts as a failed recovery (listed in `failures`; that job then stops).
Each arm's `breakdown_median` is the median of every phase over its recovered kills;
the machine's load average is sampled every 5 s during the run (`machine.loadavg`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOCAL_TIER_ENV = "RELIGHT_BENCH_LOCAL_TIER"
"""When set (by benchmarks/tiers.py), the relight arm's workers front the checkpoint
store with the node-local tier under this directory."""


# -- the worker ---------------------------------------------------------------------

def _event(out: Path, ev: str, **fields: Any) -> None:
    line = json.dumps({"ev": ev, "t": time.time(), "pid": os.getpid(), **fields})
    fd = os.open(out / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def worker(args: argparse.Namespace, t_top: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    t_import = time.time()
    out = Path(args.out)
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t_pg = time.time()
    mesh = init_device_mesh("cpu", (world,))
    numel = args.state_mib * 2**20 // 4
    local = torch.full((numel // world,), float(rank), dtype=torch.float32)
    state = {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
             "step": torch.zeros(1, dtype=torch.int64)}
    ckpt_root = args.ckpt_url
    t_state = time.time()

    if args.arm == "baseline":
        import fsspec
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        # What a torchrun + DCP user writes: s3fs through DCP's fsspec writer and reader.
        s3 = {"client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **s3)
        done = sorted(p for p in fs.glob(ckpt_root.removeprefix("s3://") + "/step_*/.metadata"))
        t_found = time.time()
        if done:
            newest = "s3://" + done[-1].rsplit("/", 1)[0]
            dcp.load(state, storage_reader=FsspecReader(newest, **s3))
        pending = None
        # DCP's async_save runs collectives from its background thread: on the training
        # group they interleave with the training loop's all_reduce and hang both. A
        # dedicated gloo group for checkpointing is what DCP's docs ask for.
        ckpt_group = dist.new_group(backend="gloo")

        def save(step: int) -> Any:
            nonlocal pending
            if pending is not None:
                pending.result()
            writer = FsspecWriter(f"{ckpt_root}/step_{step:08d}", **s3)
            pending = dcp.async_save(state, storage_writer=writer, process_group=ckpt_group)
            return pending
    else:
        from relight import ckpt

        store: Any = ckpt_root
        if os.environ.get(LOCAL_TIER_ENV):  # benchmarks/tiers.py: the node-local tier on
            from relight.ckpt.local_tier import local_tier_dir
            from relight.ckpt.tiered import TieredStore
            from relight.storage import open_store

            store = open_store(ckpt_root)
            store = TieredStore(store, local_tier_dir(os.environ[LOCAL_TIER_ENV], store.url),
                                4 << 30, writer=rank)
        mgr = ckpt.CheckpointManager(store, keep_last=2)
        latest = mgr.latest_step()
        t_found = time.time()
        if latest is not None:
            mgr.restore(state)

        def save(step: int) -> Any:
            return mgr.save(step, state, async_save=True)

    step = int(state["step"].item())
    t_restored = time.time()
    _event(out, "start", rank=rank, world=world, restart=restart, resumed=step, t_top=t_top,
           t_import=t_import, t_pg=t_pg, t_state=t_state, t_found=t_found,
           t_restored=t_restored)
    stop_file = out / "STOP"
    in_flight: tuple[int, Any] | None = None
    while True:
        step += 1
        state["w"].to_local().add_(1e-3)
        flag = torch.tensor([float(rank == 0 and stop_file.exists())])
        dist.all_reduce(flag)
        time.sleep(args.step_sleep)
        state["step"].fill_(step)
        _event(out, "step", rank=rank, restart=restart, step=step)
        # The driver kills only after a save of this generation is done, so every
        # recovery restores one (a kill before it would restart from scratch).
        if in_flight is not None and in_flight[1].done():
            _event(out, "saved", rank=rank, restart=restart, step=in_flight[0])
            in_flight = None
        if step % args.ckpt_every == 0:
            handle = save(step)  # waits for the previous save first (both arms)
            if in_flight is not None:
                _event(out, "saved", rank=rank, restart=restart, step=in_flight[0])
            in_flight = (step, handle)
        if flag.item() > 0:
            break
    if args.arm == "baseline":
        if pending is not None:
            pending.result()
    else:
        mgr.wait()
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------

def _events(out: Path) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    evs = []
    for line in path.read_text().splitlines():
        try:
            evs.append(json.loads(line))
        except ValueError:
            pass
    return evs


def _kill_all(agent: subprocess.Popen, out: Path) -> None:
    for e in _events(out):
        if e["ev"] == "start":
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    if agent.poll() is None:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        agent.wait(10)


def run_arm(arm: str, args: argparse.Namespace, work: Path, s3_env: dict[str, str],
            ckpt_url: str) -> dict[str, Any]:
    from relight.elastic.etcd_server import EtcdServer, free_port

    out = work / arm
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    etcd = None
    if arm == "baseline":
        rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    else:
        etcd = EtcdServer(out / "etcd" / "data").start()
        rdzv = ["--rdzv-backend=relight-etcd", f"--rdzv-endpoint={etcd.endpoint}",
                "--rdzv-conf=lease_ttl=5,last_call_timeout=1"]
    worker = ["-m", "relight.benchmarks.recovery", "--worker",
              "--arm", arm, "--out", str(out), "--state-mib", str(args.state_mib),
              "--ckpt-every", str(args.ckpt_every), "--step-sleep", str(args.step_sleep),
              "--ckpt-url", ckpt_url]
    env = {**os.environ, **s3_env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "RELIGHT_EVENTS_FILE": str(out / "events.jsonl")}
    warm = None
    if arm != "baseline" and args.warm:
        from relight.elastic.warm import DEFAULT_PRELOAD, WarmServer, client_command

        sock = Path(tempfile.mkdtemp(prefix="relight-warm-")) / "s.sock"
        # The worker's own imports besides a Relight worker's: s3fs, this module.
        preload = [*DEFAULT_PRELOAD, "s3fs", "relight.benchmarks.recovery"]
        warm = WarmServer(sock, preload, log_path=out / "warm.log", env=env).start()
        launch = ["--no-python", *client_command(str(sock), worker)]
    else:
        launch = ["--module", *worker[1:]]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--rdzv-id=bench",
           "--nnodes=1", f"--nproc-per-node={args.nproc}", f"--max-restarts={args.kills + 1}",
           "--monitor-interval=0.1", *launch]
    if arm == "baseline" and not args.baseline_shared_store:
        # torchrun's c10d rendezvous hands every generation's workers the agent's one
        # long-lived TCPStore: a restarted gloo group can read the dead generation's
        # addresses from it and dial them (connectFullMesh: Connection refused). Its own
        # opt-out gives each round a fresh store hosted by the new rank 0.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    log = open(out / "agent.log", "wb")  # noqa: SIM115 - the child owns it
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    log.close()
    result: dict[str, Any] = {"recovery_s": [], "breakdown": [], "failures": [],
                              "kill_steps": []}
    try:
        gen = 0  # torchrun's restart count of the running generation
        for k in range(args.kills):
            ready = _wait_generation(out, gen, args, agent)
            if ready is None:
                result["failures"].append({"kill": k, "why": "generation never stepped"})
                break
            victim, kill_step = ready
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            result["kill_steps"].append(kill_step)
            # Any later generation counts: a restart that itself fails (and is
            # restarted again) shows up as `restarts` > 1 for this kill.
            first = _wait(lambda g=gen: [e for e in _events(out) if e["ev"] == "step"
                                         and e["restart"] > g], args.recovery_timeout)
            if not first or agent.poll() is not None:
                result["failures"].append({"kill": k, "why": "no step after the kill",
                                           "agent_rc": agent.poll(), "t_kill": t_kill})
                break
            new_gen = min(e["restart"] for e in first)
            result["recovery_s"].append(min(e["t"] for e in first if e["restart"] == new_gen)
                                        - t_kill)
            result["breakdown"].append({**_breakdown(out, new_gen, t_kill),
                                        "restarts": new_gen - gen})
            gen = new_gen
        (out / "STOP").write_text("")
        try:
            agent.wait(args.recovery_timeout)
        except subprocess.TimeoutExpired:
            result["failures"].append({"why": "job did not stop"})
        result["agent_rc"] = agent.poll()
    finally:
        _kill_all(agent, out)
        if etcd is not None:
            etcd.stop()
        if warm is not None:
            warm.stop()
    rec = result["recovery_s"]
    result["median_s"] = statistics.median(rec) if rec else None
    return result


def _wait(pred: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    return None


def _wait_generation(out: Path, k: int, args: argparse.Namespace,
                     agent: subprocess.Popen) -> tuple[int, int] | None:
    def ready() -> tuple[int, int] | None:
        evs = _events(out)
        starts = [e for e in evs if e["ev"] == "start" and e["restart"] == k]
        if len(starts) < args.nproc:
            return None
        first = max(e["resumed"] for e in starts)
        done = [e["step"] for e in evs if e["ev"] == "step" and e["restart"] == k
                and e["rank"] == 1]
        saved = {e["rank"] for e in evs if e["ev"] == "saved" and e["restart"] == k}
        if (done and max(done) >= first + args.ckpt_every + 2
                and len(saved) == args.nproc):  # a checkpoint of this generation is done
            return next(e["pid"] for e in starts if e["rank"] == 1), max(done)
        return None

    return _wait(lambda: agent.poll() is None and ready(), args.recovery_timeout)


def _breakdown(out: Path, gen: int, t_kill: float) -> dict[str, float]:
    evs = _events(out)
    starts = [e for e in evs if e["ev"] == "start" and e["restart"] == gen]
    steps = [e["t"] for e in evs if e["ev"] == "step" and e["restart"] == gen]
    b = {
        "to_process_s": max(e["t_top"] for e in starts) - t_kill,
        "import_s": max(e["t_import"] - e["t_top"] for e in starts),
        "init_pg_s": max(e["t_pg"] - e["t_import"] for e in starts),
        "restore_s": max(e["t_restored"] - e["t_pg"] for e in starts),
        "first_step_s": min(steps) - max(e["t_restored"] for e in starts),
    }
    rdzv = [e for e in evs if e["ev"] == "rdzv_start" and e["t"] > t_kill]
    done = [e for e in evs if e["ev"] == "rdzv_done" and e["t"] > t_kill]
    if rdzv and done:
        b["detect_s"] = rdzv[0]["t"] - t_kill
        b["rendezvous_s"] = done[0]["t"] - rdzv[0]["t"]
    b = {k: round(v, 4) for k, v in b.items()}
    b["resumed_step"] = min(e["resumed"] for e in starts)  # 0: nothing was restored
    return b


class _LoadSampler:
    """The machine's 1-minute load average every `interval` s, in a daemon thread."""

    def __init__(self, interval: float = 5.0) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            self.samples.append(round(os.getloadavg()[0], 2))
            self._stop.wait(interval)

    def __enter__(self) -> _LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def summary(self) -> dict[str, float]:
        s = self.samples or [os.getloadavg()[0]]
        return {"min": min(s), "median": statistics.median(s), "max": max(s), "n": len(s)}


def _median_breakdown(breakdowns: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for b in breakdowns for k in b if k != "restarts"})
    return {k: round(statistics.median([b[k] for b in breakdowns if k in b]), 4)
            for k in keys}


def job_argument_parser(prog: str, doc: str | None, arms: str) -> argparse.ArgumentParser:
    """The options of a kill-and-recover job (shared by benchmarks.recovery and .tiers)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0] if doc else None)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--state-mib", type=int, default=256)
    p.add_argument("--kills", type=int, default=3, help="kills per job")
    p.add_argument("--jobs", type=int, default=1, help="fresh jobs per arm")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--recovery-timeout", type=float, default=180.0)
    p.add_argument("--arms", default=arms)
    p.add_argument("--workdir", default=None)
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="start Relight's workers through a per-node fork server with torch "
                        "and the engine imported (elastic.warm), as `relight run` does by "
                        "default; --no-warm measures cold starts")
    p.add_argument("--baseline-shared-store", action="store_true",
                   help="run the baseline's workers on torchrun's shared rendezvous TCPStore "
                        "(its default; restarted groups then fail in init_process_group on "
                        "this machine) instead of a fresh store per round")
    return p


def main(argv: list[str] | None = None) -> int:
    t_top = time.time()
    p = job_argument_parser("python -m relight.benchmarks.recovery", __doc__, "baseline,relight")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args, t_top)
        return 0
    from relight.chaos.s3_server import S3Server

    work = Path(args.workdir or tempfile.mkdtemp(prefix="relight-recovery-"))
    results: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items()
                   if k not in ("worker", "arm", "out", "ckpt_url")},
        "machine": {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
    }
    s3 = S3Server(work / "s3").start()
    try:
        with _LoadSampler() as load:
            for arm in args.arms.split(","):
                results[arm] = _run_jobs(arm, args, work, s3)
    finally:
        s3.stop()
    results["machine"]["loadavg_after"] = os.getloadavg()
    results["machine"]["loadavg"] = load.summary()
    results["checkpoints"] = f"S3 (SeaweedFS at {s3.endpoint_url}), {s3.url('recovery/')}"
    base = results.get("baseline", {}).get("median_s")
    mine = results.get("relight", {}).get("median_s")
    results["ratio"] = (mine / base) if base and mine else None
    text = json.dumps(results, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


def _run_jobs(arm: str, args: argparse.Namespace, work: Path, s3: Any) -> dict[str, Any]:
    merged: dict[str, Any] = {"recovery_s": [], "breakdown": [], "failures": [],
                              "kill_steps": [], "agent_rc": []}
    for job in range(args.jobs):
        print(f"[recovery] {arm} job {job}: {args.kills} kills, {args.state_mib} MiB",
              file=sys.stderr, flush=True)
        url = s3.url(f"recovery/{work.name}/job{job}/{arm}")
        one = run_arm(arm, args, work / f"job{job}", s3.env(), url)
        for key in ("recovery_s", "breakdown", "failures", "kill_steps"):
            merged[key] += [dict(f, job=job) for f in one[key]] if key == "failures" \
                else one[key]
        merged["agent_rc"].append(one["agent_rc"])
        print(f"[recovery] {arm} job {job}: recovery_s={one['recovery_s']} "
              f"failures={one['failures']}", file=sys.stderr, flush=True)
    rec = merged["recovery_s"]
    merged["median_s"] = statistics.median(rec) if rec else None
    merged["breakdown_median"] = _median_breakdown(merged["breakdown"])
    failed_kills = [f for f in merged["failures"] if "kill" in f]
    merged["recovered"] = f"{len(rec)} of {len(rec) + len(failed_kills)} kills"
    return merged


if __name__ == "__main__":
    sys.exit(main())
