"""`relight ckpt ...`: list, inspect, verify, garbage-collect, export, import and diff
checkpoints.

Exit codes: 0 ok (diff: identical); 1 a checkpoint failed verification, is corrupt, or
(diff) the two differ; 2 usage error; 3 no checkpoint found; 4 storage error.

Long work (export, import-dcp, verify, gc, diff) shows a progress bar on stderr when stderr
is a terminal; --json, or output to a pipe or file, turns it off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import TracebackType
from typing import Any

from relight.ckpt.errors import CheckpointError, CheckpointNotFoundError
from relight.ckpt.export import diff, export_dcp, export_safetensors, import_dcp
from relight.ckpt.format import COMMIT_KEY, MANIFEST_KEY
from relight.ckpt.manager import KeepEvery, KeepLast, collect_garbage
from relight.ckpt.manifest import read_manifest
from relight.ckpt.root_layout import list_records, step_dir
from relight.ckpt.verify import verify
from relight.storage import StorageError, Store, open_store

__all__ = ["main"]

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_STORAGE = 0, 1, 2, 3, 4
EXIT_CODES = ("exit status: 0 ok (diff: identical); 1 verification failed, corrupt, or "
              "(diff) different; 2 usage error; 3 no checkpoint found; 4 storage error")


class ProgressBar:
    """A rich progress bar on stderr, used as `progress(done, total, item)` callbacks.

    Off (every call a no-op) unless `enabled` and stderr is a terminal, so scripts, pipes
    and `--json` output never see it; `transient`: it disappears when the work is done.
    `unit` is "bytes" (size and rate columns) or "items" (a count). A total of 0 shows a
    spinner with the elapsed time (work of unknown size).
    """

    def __init__(self, label: str, *, enabled: bool, unit: str = "bytes",
                 console: Any = None) -> None:
        self.label = label
        self.unit = unit
        self._console = console
        self.enabled = enabled and (console is not None or sys.stderr.isatty())
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressBar:
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        counts = ([DownloadColumn(), TransferSpeedColumn()] if self.unit == "bytes"
                  else [MofNCompleteColumn()])
        self._progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), *counts,
            TimeElapsedColumn(), TimeRemainingColumn(),
            console=self._console or Console(stderr=True), transient=True)
        self._progress.start()
        self._task = self._progress.add_task(self.label, total=None)
        return self

    def __call__(self, done: int, total: int, item: str = "") -> None:
        if self._progress is None:
            return
        tail = item if len(item) <= 32 else "..." + item[-29:]
        self._progress.update(self._task, completed=done, total=total or None,
                              description=f"{self.label} {tail}".rstrip())

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _is_checkpoint(store: Store) -> bool:
    return store.exists(COMMIT_KEY) or store.exists(MANIFEST_KEY)


def _resolve(url: str, step: int | None) -> Store:
    """The checkpoint store: URL itself, URL/step-N, or the newest committed under URL."""
    store = open_store(url)
    if step is not None:
        return store.child(step_dir(step))
    if _is_checkpoint(store):
        return store
    records = list_records(store)
    for s in sorted((s for s, r in records.items() if r.committed), reverse=True):
        child = store.child(step_dir(s))
        if child.exists(COMMIT_KEY):
            return child
    raise CheckpointNotFoundError(f"no committed checkpoint under {store.url}", url=store.url)


def _age(created: float | None) -> str:
    if not created:
        return "?"
    s = max(0.0, time.time() - created)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


def _entry(store: Store, step: int | None) -> dict[str, Any]:
    committed = store.exists(COMMIT_KEY)
    e: dict[str, Any] = {"step": step, "url": store.url, "committed": committed}
    if committed:
        try:
            m = read_manifest(store)
            e.update(bytes=m.bytes, world_size=m.world_size, layout=m.layout,
                     created_unix=m.created_unix, tensors=len(m.tensors))
        except CheckpointError as err:
            e["error"] = str(err)
    return e


def cmd_ls(args: argparse.Namespace) -> int:
    store = open_store(args.url)
    if _is_checkpoint(store):
        entries = [_entry(store, None)]
    else:
        entries = [_entry(store.child(step_dir(s)), s) for s in sorted(list_records(store))]
    if args.json:
        print(json.dumps(entries, indent=1))
    else:
        print(f"{'STEP':>10}  {'STATE':<11} {'SIZE':>10} {'WORLD':>5} {'AGE':>7}  LAYOUT")
        for e in entries:
            state = "committed" if e["committed"] else "uncommitted"
            if e.get("error"):
                state = "corrupt"
            size = f"{e['bytes'] / 2**20:.1f}MiB" if e.get("bytes") is not None else "-"
            print(f"{e['step'] if e['step'] is not None else '-':>10}  {state:<11} {size:>10} "
                  f"{e.get('world_size') or '-':>5} {_age(e.get('created_unix')):>7}  "
                  f"{json.dumps(e.get('layout')) if e.get('layout') else '-'}")
    if not entries:
        print(f"no checkpoints under {store.url}", file=sys.stderr)
        return EXIT_NOT_FOUND
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    store = _resolve(args.url, args.step)
    m = read_manifest(store)
    if args.json:
        print(json.dumps({k: v for k, v in m.to_json().items() if k != "index"}, indent=1))
        return EXIT_OK
    writer = m.writer if isinstance(m.writer, dict) else {}
    print(f"checkpoint {store.url}")
    print(f"  step {m.step}  created {m.created}  world {m.world_size}  "
          f"format v{m.version}  writer {writer.get('version')}")
    print(f"  layout {json.dumps(m.layout)}")
    print(f"  config {json.dumps(m.config)[:200]}")
    print(f"  {len(m.tensors)} tensors, {(m.bytes or 0) / 2**20:.1f} MiB; "
          f"{len(m.values)} values")
    for name, t in sorted(m.tensors.items()):
        print(f"  {name:<50} {t.dtype:<9} {str(t.shape):<20} {t.storage:<7} "
              f"{t.placements if t.placements is not None else ''}")
    return EXIT_OK


def _committed_stores(url: str) -> list[Store]:
    """Every committed step under a run root, oldest first (or the checkpoint itself)."""
    store = open_store(url)
    if _is_checkpoint(store):
        return [store]
    steps = sorted(s for s, r in list_records(store).items() if r.committed)
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint under {store.url}",
                                      url=store.url)
    return [store.child(step_dir(s)) for s in steps]


def cmd_verify(args: argparse.Namespace) -> int:
    if args.all_steps and args.step is not None:
        print("error: --all-steps and --step exclude each other", file=sys.stderr)
        return EXIT_USAGE
    stores = _committed_stores(args.url) if args.all_steps else [_resolve(args.url, args.step)]
    reports = []
    for store in stores:
        with ProgressBar(f"verify {store.url}", enabled=not args.json, unit="items") as bar:
            reports.append(verify(store, read_data=not args.quick, progress=bar))
    if args.json:
        out = [r.to_json() for r in reports]
        print(json.dumps(out if args.all_steps else out[0], indent=1))
    else:
        for report in reports:
            print(f"{'OK' if report.ok else 'FAILED'} {report.url}: step {report.step}, "
                  f"{report.tensors} tensors, {report.objects} objects, {report.bytes} bytes "
                  "read")
            for p in report.problems:
                print(f"  - {p}")
    return EXIT_OK if all(r.ok for r in reports) else EXIT_BAD


def cmd_gc(args: argparse.Namespace) -> int:
    store = open_store(args.url)
    policies: list[Any] = [KeepLast(args.keep_last)]
    if args.keep_every:
        policies.append(KeepEvery(args.keep_every))
    with ProgressBar(f"gc {store.url}", enabled=not args.json, unit="items"):
        deleted = collect_garbage(store, policies, args.grace_s)
    if args.json:
        print(json.dumps({"deleted": deleted}))
    else:
        print(f"deleted {len(deleted)} checkpoint(s): {deleted}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    store = _resolve(args.url, args.step)
    with ProgressBar("export", enabled=not args.json) as bar:
        if args.to:
            out = export_safetensors(store, args.to, all_tensors=args.all, progress=bar)
        else:
            out = export_dcp(store, args.to_dcp, all_tensors=args.all, progress=bar)
    out["from"] = store.url
    if args.json:
        print(json.dumps(out))
    else:
        extra = f" and {out['values']} values" if out.get("values") else ""
        print(f"exported {out['tensors']} tensors ({out['bytes'] / 2**20:.1f} MiB){extra} from "
              f"{store.url} to {out['path']}")
    return EXIT_OK


def cmd_import_dcp(args: argparse.Namespace) -> int:
    with ProgressBar("import", enabled=not args.json) as bar:
        out = import_dcp(args.dir, args.url, step=args.step, progress=bar)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"imported {out['tensors']} tensors ({out['bytes'] / 2**20:.1f} MiB) and "
              f"{out['values']} values from "
              f"{args.dir} to {args.url}" + (f" step {args.step}" if args.step is not None else ""))
        if out["skipped"]:
            print(f"  skipped {len(out['skipped'])} non-tensor entries: {out['skipped'][:10]}")
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    with ProgressBar("diff", enabled=not args.json) as bar:
        report = diff(_resolve(args.url_a, args.step_a), _resolve(args.url_b, args.step_b),
                      progress=bar)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(f"{'IDENTICAL' if report.identical else 'DIFFERENT'} A={report.url_a} "
              f"B={report.url_b}")
        for name in report.only_a:
            print(f"  only in A: {name}")
        for name in report.only_b:
            print(f"  only in B: {name}")
        for name, why in report.mismatched.items():
            print(f"  shape/dtype: {name}: {why}")
        for name in report.values_differ:
            print(f"  value differs: {name}")
        for t in report.tensors:
            if not t.identical:
                print(f"  {t.name:<50} max_abs {t.max_abs:.4g}  max_rel {t.max_rel:.4g}")
        same = sum(t.identical for t in report.tensors)
        print(f"  {same}/{len(report.tensors)} common tensors bitwise identical")
    return EXIT_OK if report.identical else EXIT_BAD


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relight ckpt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="steps under a run root: committed or not, size, layout, age")
    ls.add_argument("url")
    ls.set_defaults(fn=cmd_ls)
    ins = sub.add_parser("inspect", help="tensors, shapes, dtypes, layout of one checkpoint")
    ins.add_argument("url")
    ins.add_argument("--step", type=int)
    ins.set_defaults(fn=cmd_inspect)
    ver = sub.add_parser(
        "verify", help="every chunk present and its checksum right",
        description="Verify one checkpoint. Given a run root, only the newest committed step "
        "is checked (or --step N); --all-steps checks every committed step.")
    ver.add_argument("url")
    ver.add_argument("--step", type=int)
    ver.add_argument("--all-steps", action="store_true",
                     help="every committed step under a run root, oldest first (--json: a list)")
    ver.add_argument("--quick", action="store_true", help="check objects exist, skip reading")
    ver.set_defaults(fn=cmd_verify)
    gc = sub.add_parser("gc", help="delete old and stale checkpoints")
    gc.add_argument("url")
    gc.add_argument("--keep-last", type=int, required=True)
    gc.add_argument("--keep-every", type=int)
    gc.add_argument("--grace-s", type=float, default=3600.0,
                    help="uncommitted checkpoints younger than this are left alone")
    gc.set_defaults(fn=cmd_gc)
    ex = sub.add_parser(
        "export", help="consolidated full weights as safetensors or a DCP checkpoint",
        description="Write the model/... tensors (all tensors with --all) of one committed "
        "checkpoint, full (unsharded), streamed: one tensor in memory at a time. "
        "safetensors keys drop the 'model.' prefix (model.load_state_dict-ready); with --all "
        "keys are the state-dict paths joined with '.'. DCP keys follow the same rule; with "
        "--all --to-dcp the JSON values (optimizer param_groups, step) are written too, so "
        "dcp.load of a full model + optimizer state dict finds every key.")
    ex.add_argument("url", help="a checkpoint, or a run root (newest committed, or --step)")
    ex.add_argument("--step", type=int)
    dst = ex.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to", metavar="FILE", help="a local .safetensors file to write")
    dst.add_argument("--to-dcp", metavar="DIR",
                     help="a local directory to write a torch.distributed.checkpoint into")
    ex.add_argument("--all", action="store_true",
                    help="every tensor (optimizer state too), not only model/...")
    ex.set_defaults(fn=cmd_export)
    im = sub.add_parser(
        "import-dcp", help="save a torch.distributed.checkpoint directory as a Relight checkpoint",
        description="Read a local DCP checkpoint (tensors and plain non-tensor entries such "
        "as an optimizer's param_groups) and save it with ckpt.save. Every entry lands at the "
        "path DCP's metadata records for it (optim.state.<fqn>.exp_avg -> "
        "optim/state/<fqn>/exp_avg). SECURITY: DCP's .metadata file is a pickle, unpickled by "
        "torch.distributed.checkpoint; import only directories you trust. Non-tensor entries "
        "are read with torch.load(weights_only=True); Relight's own load paths never "
        "unpickle.")
    im.add_argument("dir", help="local DCP checkpoint directory (with .metadata)")
    im.add_argument("url", help="where to save: a checkpoint URL, or a run root with --step")
    im.add_argument("--step", type=int, help="save as this step of the run root URL")
    im.set_defaults(fn=cmd_import_dcp)
    df = sub.add_parser(
        "diff", help="per-tensor max abs/rel difference of two checkpoints",
        description="Compare two committed checkpoints tensor by tensor. max_rel is "
        "max |a-b| / max(|a|,|b|) over elements. Exit 0 when identical (bitwise, same "
        "keys, same values), 1 when different.")
    df.add_argument("url_a")
    df.add_argument("url_b")
    df.add_argument("--step-a", type=int)
    df.add_argument("--step-b", type=int)
    df.set_defaults(fn=cmd_diff)
    for sp in (ls, ins, ver, gc, ex, im, df):
        sp.add_argument("--json", action="store_true",
                        help="machine-readable output on stdout (and no progress bar)")
        sp.epilog = EXIT_CODES
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else EXIT_OK
    try:
        return int(args.fn(args))
    except CheckpointNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD
    except (StorageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_STORAGE


if __name__ == "__main__":
    sys.exit(main())
