"""Fleet benchmark: many writer processes, as hosts x ranks, committing into ONE store at once.

    python bench/fleet.py                          # moto's S3 server, started here; about 2.5 minutes
    python bench/fleet.py --seconds 20             # a quicker look
    python bench/fleet.py --store /tmp/fleet       # a local folder
    python bench/fleet.py --store s3://bucket/prefix --storage-option endpoint=http://127.0.0.1:9000 \\
        --storage-option allow_http=true --storage-option region=us-east-1   # MinIO etc.

What runs: `--writers` processes (default 8) spread over `--hosts` host names (default 4, so 2
ranks per host: MOESCOPE_HOST=host-<i>, RANK, WORLD_SIZE, one MOESCOPE_RUN_ID, as a launcher sets
them) write one run through moescope's real write path (the probe's pipeline, ParquetExporter, one
Delta commit per table per flush) at moescope's default flush (5 s, 256 Ki rows or 64 MiB per table),
while a compactor process compacts the run every `--compact-every` seconds and a reader process
queries it in a loop. Records are synthetic (a probe's StepRecords with routes: `--layers` x
`--tokens` route rows each, generated before the clock starts), so the figures are the store's,
not a model's.

Two phases, each with fresh processes and a fresh run (`--phases`):
  saturated  every writer emits as fast as the store takes rows (the pipeline blocks when full):
             the rows/s the store sustains with this many committers.
  paced      every writer emits `--rate` route rows/s (default 20 000, a decode server of ~600
             tokens/s over 32 MoE layers): what a fleet at ordinary load bills per writer.

What it prints, per phase (median over writers and [min - max] for the spread, with the load
average at start and end beside them: on a shared machine the figures move with it):
  route rows/s          committed route rows per second, total and per writer
  commits, conflicts    commits made; conflicts retried = log-entry PUTs the server refused with
                        412 Precondition Failed (another writer took that version first, and
                        delta-rs tried the next one). Counted by the server, so only where the
                        requests are counted (below); never for a local folder.
  commit latency        p50 / p99 of `store.delta.commit` (re-read the log, write the entry,
                        retries included), and of the Parquet upload before it
  requests/writer/min   each writer's PUT, POST, LIST, GET, HEAD per minute, and what that costs at
                        S3 Standard's list prices (stated in the output)
  compactions, reader   compactions that merged files and how long each took; reader queries,
                        their latency and errors
  rows                  the snapshot's route rows (delta-rs) against what the writers reported

Requests are counted where they arrive. With no --store, this script runs moto's S3 server in a
child process with two ports onto one bucket: the writers use one, the compactor and the reader the
other, and each request is counted by kind (a GET listing a prefix is a LIST, billed like a PUT),
table part (log or data) and status. With --store s3://... over plain http (MinIO) and
--count-requests, tests/support/s3faults.py's proxy counts the writers' requests by HTTP method only
(LISTs inside GET) and adds its own latency to every request. In a store you give, the runs
written (fleet-<phase>-<time>-<id>) are left there: `moescope prune` removes them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# S3 Standard list prices (us-east-1, 2025): PUT, COPY, POST, LIST requests; GET and other requests.
CLASS_A = ("PUT", "POST", "LIST", "COPY")
PRICE_CLASS_A_PER_1000 = 0.005
PRICE_CLASS_B_PER_1000 = 0.0004
MINUTES_PER_MONTH = 30 * 24 * 60
START_TIMEOUT_S = 300.0


# -- the processes ------------------------------------------------------------------------------------

class Process:
    """A child of this script (`--child ROLE`): stdout lines collected by a thread, stderr to a
    temporary file, stdin kept open (a line is a cue, closing it the signal to stop)."""

    def __init__(self, role: str, args: list[str], env: dict[str, str] | None = None):
        self.role = role
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", role, *args], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.last_line_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.last_line_at = time.monotonic()

    def send(self, line: str) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def said(self, word: str) -> bool:
        return any(line == word or line.startswith(word + " ") for line in self.lines)

    def result(self) -> dict[str, Any]:
        for line in reversed(self.lines):
            if line.startswith("result "):
                return json.loads(line[len("result "):])
        self._stderr.seek(0)
        raise RuntimeError(f"{self.role} (exit {self.proc.poll()}) gave no result: {self._stderr.read()[-3000:]}")

    def stop(self) -> None:
        """Kill it if it still runs; safe twice."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream:
                    stream.close()
        self._reader.join(timeout=10)
        self._stderr.close()


def _option_args(options: dict[str, str]) -> list[str]:
    return [arg for key, value in options.items() for arg in ("--storage-option", f"{key}={value}")]


def _wait_all(processes: list[Process], word: str, timeout_s: float, progress: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    done = 0
    while time.monotonic() < deadline:
        now_done = sum(p.said(word) for p in processes)
        if progress is not None and now_done > done:
            progress.update(now_done - done)
        done = now_done
        if done == len(processes):
            return
        for p in processes:
            if p.proc.poll() is not None and not p.said(word):
                p.result()  # raises with its stderr
        time.sleep(0.1)
    raise RuntimeError(f"not every process said {word!r} within {timeout_s:.0f} s")


# -- one phase ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
    url: str  # the store
    options: dict[str, str]  # how the compactor and the reader reach it
    writer_options: dict[str, str]  # how the writers reach it (where their requests are counted)
    counter: Any  # counts the writers' requests (`reset()`, `counts()`), or None
    where: str  # what the store is, in words


def run_phase(setup: Setup, args: argparse.Namespace, phase: str, rate: float) -> dict[str, Any]:
    """Run the writers (and compactor and reader) for one phase; returns its figures."""
    from tqdm import tqdm

    run_id = f"fleet-{phase}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    common = ["--store", setup.url]
    ranks_per_host = max(1, -(-args.writers // args.hosts))
    processes: list[Process] = []
    try:
        writers = [Process("writer", [*common, *_option_args(setup.writer_options), "--seconds", str(args.seconds),
                                      "--rate", str(rate), "--layers", str(args.layers), "--tokens", str(args.tokens),
                                      "--experts", str(args.experts)],
                           env={"MOESCOPE_RUN_ID": run_id, "RANK": str(rank), "WORLD_SIZE": str(args.writers),
                                "MOESCOPE_HOST": f"host-{rank // ranks_per_host}", "OMP_NUM_THREADS": "1"})
                   for rank in range(args.writers)]
        processes += writers
        helpers = []
        if args.compact_every > 0:
            helpers.append(Process("compactor", [*common, *_option_args(setup.options), "--run", run_id,
                                                 "--every", str(args.compact_every)]))
        if args.reader:
            helpers.append(Process("reader", [*common, *_option_args(setup.options), "--run", run_id]))
        processes += helpers
        with tqdm(total=len(processes), desc=f"{phase}: starting", unit="process", leave=False) as bar:
            _wait_all(processes, "ready", START_TIMEOUT_S, bar)
        if setup.counter is not None:
            setup.counter.reset()
        load_start = os.getloadavg()
        started = time.monotonic()
        for process in [*writers, *helpers]:
            process.send("go")
        with tqdm(total=int(args.seconds), desc=f"{phase}: writing", unit="s", leave=False) as bar:
            while any(w.proc.poll() is None for w in writers):
                time.sleep(1.0)
                bar.update(min(1, bar.total - bar.n))
                if time.monotonic() - started > args.seconds + 600:
                    raise RuntimeError("the writers did not finish within 10 minutes of their time")
        elapsed = time.monotonic() - started
        load_end = os.getloadavg()
        requests = setup.counter.counts() if setup.counter is not None else None
        reports = [w.result() for w in writers]
        for helper in helpers:
            helper.close_stdin()
        # each finishes the call it is in, within a bound: a reader still checking every file it
        # has not seen (on S3, behind 8 writers) could take minutes
        grace = time.monotonic() + args.helper_grace
        side: dict[str, Any] = {}
        with tqdm(total=len(helpers), desc=f"{phase}: compactor and reader finishing", leave=False) as bar:
            for helper in helpers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    helper.proc.wait(timeout=max(0.0, grace - time.monotonic()))
                stopped_at = time.monotonic()
                if helper.proc.poll() is None:
                    helper.proc.kill()
                    helper.proc.wait(timeout=30)
                side[helper.role] = helper_summary(helper, "compact" if helper.role == "compactor" else "query",
                                                   stopped_at)
                bar.update(1)
    finally:
        for process in processes:
            process.stop()
    snapshot_rows = _snapshot_rows(setup, "routes", run_id)
    return figures(phase, rate, args, reports, requests, elapsed, load_start, load_end, side, snapshot_rows)


def _snapshot_rows(setup: Setup, table: str, run_id: str) -> int | None:
    """The run's rows in the table's latest snapshot, counted by delta-rs and pyarrow (not moescope)."""
    import deltalake
    import pyarrow.dataset as ds

    uri = f"{setup.url.rstrip('/')}/{table}" if "://" in setup.url else os.path.join(setup.url, table)
    try:
        delta_table = deltalake.DeltaTable(uri, storage_options=setup.options or None)
        dataset = delta_table.to_pyarrow_dataset()
        return dataset.count_rows(filter=ds.field("run_id") == run_id)
    except Exception as e:  # noqa: BLE001 - a figure we could not read is printed as such
        print(f"could not count the snapshot's rows: {type(e).__name__}: {e}", file=sys.stderr)
        return None


# -- the figures -----------------------------------------------------------------------------------------

def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _spread(values: list[float]) -> tuple[float, float, float]:
    return (statistics.median(values), min(values), max(values)) if values else (float("nan"),) * 3


def figures(phase: str, rate: float, args: argparse.Namespace, reports: list[dict], requests: dict | None,
            elapsed: float, load_start: tuple, load_end: tuple, side: dict, snapshot_rows: int | None) -> dict:
    commit_s = [s for r in reports for s in r["commit_s"]]
    upload_s = [s for r in reports for s in r["upload_s"]]
    per_writer = [r["routes_rows"] / r["seconds"] for r in reports]
    out: dict[str, Any] = {
        "phase": phase, "rate": rate, "writers": len(reports), "hosts": len({r["host"] for r in reports}),
        "seconds": elapsed, "emit_seconds": statistics.median(r["emit_seconds"] for r in reports),
        "route_rows": sum(r["routes_rows"] for r in reports),
        "route_rows_per_s": sum(r["routes_rows"] for r in reports) / max(r["seconds"] for r in reports),
        "route_rows_per_s_per_writer": _spread(per_writer),
        "route_rows_per_s_emitting": sum(r["routes_rows"] for r in reports) / statistics.median(
            r["emit_seconds"] for r in reports),
        "commits": sum(r["commits"] for r in reports), "commit_p50_s": _quantile(commit_s, 0.5),
        "commit_p99_s": _quantile(commit_s, 0.99),
        "commit_p50_s_per_writer": _spread([_quantile(r["commit_s"], 0.5) for r in reports]),
        "upload_p50_s": _quantile(upload_s, 0.5), "upload_p99_s": _quantile(upload_s, 0.99),
        "dropped_rows": sum(sum(r["dropped"].values()) for r in reports),
        "load_start": load_start[0], "load_end": load_end[0], "cpus": os.cpu_count(),
        "snapshot_route_rows": snapshot_rows, "compactor": side.get("compactor"), "reader": side.get("reader"),
    }
    if requests is not None:
        minutes = elapsed / 60
        by_kind: dict[str, int] = {}
        for key, n in requests.items():  # "KIND PART STATUS"
            kind = key.split()[0]
            by_kind[kind] = by_kind.get(kind, 0) + n
        per_minute = {kind: n / len(reports) / minutes for kind, n in sorted(by_kind.items())}
        out["requests"] = requests
        out["requests_per_writer_per_minute"] = per_minute
        out["conflicts_retried"] = sum(n for key, n in requests.items() if key.startswith("PUT") and
                                       key.endswith(" 412"))
        class_a = sum(per_minute.get(kind, 0) for kind in CLASS_A)
        class_b = sum(n for kind, n in per_minute.items() if kind not in CLASS_A and kind != "DELETE")
        out["usd_per_writer_per_month"] = (class_a * PRICE_CLASS_A_PER_1000 + class_b * PRICE_CLASS_B_PER_1000) \
            / 1000 * MINUTES_PER_MONTH
    return out


def _k(value: float) -> str:
    if value != value:  # NaN
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.2f} M"
    if value >= 1e3:
        return f"{value / 1e3:.1f} k"
    return f"{value:.0f}"


def report(out: dict, setup: Setup, args: argparse.Namespace) -> str:
    median, low, high = out["route_rows_per_s_per_writer"]
    c50, clow, chigh = out["commit_p50_s_per_writer"]
    what = "as fast as the store takes them" if not out["rate"] else f"{_k(out['rate'])} route rows/s per writer"
    lines = [
        f"phase {out['phase']} ({what}); {out['writers']} writers on {out['hosts']} hosts, {setup.where}, "
        f"{out['emit_seconds']:.0f} s of emitting, drained by {out['seconds']:.0f} s",
        f"  load average          {out['load_start']:.1f} at start, {out['load_end']:.1f} at end ({out['cpus']} CPUs)",
        f"  route rows/s          total {_k(out['route_rows_per_s'])} committed to the end of the drain "
        f"({_k(out['route_rows_per_s_emitting'])} over the emitting); per writer median {_k(median)} "
        f"[{_k(low)} - {_k(high)}]",
        f"  commits               {out['commits']} ({out['commits'] / out['seconds']:.1f}/s); conflicts retried "
        + (f"{out['conflicts_retried']} (412 on a log PUT)" if "conflicts_retried" in out else
           "not counted (requests are not counted for this store)"),
        f"  commit latency        p50 {out['commit_p50_s'] * 1e3:.0f} ms, p99 {out['commit_p99_s'] * 1e3:.0f} ms; "
        f"per writer p50 median {c50 * 1e3:.0f} ms [{clow * 1e3:.0f} - {chigh * 1e3:.0f}]",
        f"  upload latency        p50 {out['upload_p50_s'] * 1e3:.0f} ms, p99 {out['upload_p99_s'] * 1e3:.0f} ms",
    ]
    if "requests_per_writer_per_minute" in out:
        per_minute = ", ".join(f"{m} {n:.0f}" for m, n in out["requests_per_writer_per_minute"].items())
        lines.append(f"  requests/writer/min   {per_minute}: ${out['usd_per_writer_per_month']:.2f} per writer per "
                     f"month at S3 Standard list prices (${PRICE_CLASS_A_PER_1000} per 1000 PUT/POST/LIST, "
                     f"${PRICE_CLASS_B_PER_1000} per 1000 GET/HEAD)")
        parts: dict[str, dict[str, float]] = {}
        minutes = out["seconds"] / 60
        for key, n in out["requests"].items():
            kind, part, _ = key.split()
            parts.setdefault(part, {})
            parts[part][kind] = parts[part].get(kind, 0) + n / out["writers"] / minutes
        if set(parts) != {"?"}:
            lines.append("    by part             " + "; ".join(
                f"{part}: " + ", ".join(f"{kind} {n:.0f}" for kind, n in sorted(kinds.items()))
                for part, kinds in sorted(parts.items())))
    for role, what in (("compactor", "runs of compact"), ("reader", "queries")):
        done = out[role]
        if done is None:
            continue
        took = _spread(done["seconds"])
        merged = f" ({done['merged']} merged files)" if role == "compactor" else ""
        each = f", each median {took[0]:.2f} s [{took[1]:.2f} - {took[2]:.2f}]" if done["seconds"] else ""
        unfinished = (f"; stopped {done['unfinished_s']:.0f} s into one more" if done["unfinished_s"] >= 1 else "")
        lines.append(f"  {role:<22}{done['runs']} {what}{merged}{each}{unfinished}; {done['error_count']} errors"
                     + (f" (first: {done['errors'][0][:200]})" if done["errors"] else ""))
    snapshot = out["snapshot_route_rows"]
    lines.append(f"  rows                  {out['route_rows']} route rows reported written, "
                 f"{snapshot if snapshot is not None else '?'} in the snapshot; {out['dropped_rows']} dropped")
    return "\n".join(lines)


# -- where the store is ----------------------------------------------------------------------------------

@contextlib.contextmanager
def store_setup(args: argparse.Namespace):
    """The store to write: a local folder, the S3 store given, or (none given) a moto server of our
    own whose writers' port counts their requests."""
    if args.store and "://" not in args.store:
        root = os.path.abspath(args.store)
        os.makedirs(root, exist_ok=True)
        yield Setup(root, {}, {}, None, f"local folder {root}")
        return
    if not args.store:
        with CountingS3() as server:
            url = f"s3://{server.bucket}/bench-fleet-{uuid.uuid4().hex[:8]}"
            yield Setup(url, server.storage_options(server.others), server.storage_options(server.writers), server,
                        "moto's S3 server on 127.0.0.1 (started here)")
        return
    from moescope.store.location import open_location

    location = open_location(args.store, args.storage_option or None)
    url, options = location.url, dict(location.storage_options)
    endpoint = options.get("AWS_ENDPOINT_URL", "")
    if not (args.count_requests and url.startswith("s3://") and endpoint.startswith("http://")):
        yield Setup(url, options, options, None, location.redacted)
        return
    sys.path.insert(0, REPO)  # tests/ holds the proxy
    from tests.support.s3faults import FaultProxy

    with FaultProxy(endpoint, lifetime_s=24 * 3600) as proxy:
        yield Setup(url, options, {**options, "AWS_ENDPOINT_URL": proxy.url}, ProxyCounts(proxy),
                    f"{location.redacted} (writers through a counting proxy)")


class ProxyCounts:
    """The writers' requests as tests/support/s3faults.py's proxy counts them: by HTTP method (LISTs are
    GETs there), and 412 answers (conflicts) over all methods."""

    def __init__(self, proxy: Any):
        self.proxy = proxy

    def reset(self) -> None:
        self.proxy.reset_counts()

    def counts(self) -> dict[str, int]:
        seen = self.proxy.counts()
        out = {f"{method} ? ?": n for method, n in seen["requests"].items()}
        if seen["statuses"].get("412"):
            out["PUT ? 412"] = seen["statuses"]["412"]
            out["PUT ? ?"] = out.get("PUT ? ?", 0) - seen["statuses"]["412"]
        return out


class CountingS3:
    """moto's S3 server in a child process (`--child s3`), one bucket behind two ports: `writers`
    (each request counted by kind, table part and status) and `others` (the compactor, the reader,
    this script). Credentials are any: the bench sets its own in the environment."""

    bucket = "fleet-bench"

    def __init__(self) -> None:
        os.environ.update({"AWS_ACCESS_KEY_ID": "fleet-bench", "AWS_SECRET_ACCESS_KEY": "fleet-bench",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
        for key in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(key, None)
        self.process = Process("s3", ["--bucket", self.bucket])
        try:
            _wait_all([self.process], "ready", 60)
            ports = json.loads(next(line for line in self.process.lines if line.startswith("ready "))[6:])
        except BaseException:
            self.process.stop()
            raise
        self.writers, self.others = ports["writers"], ports["others"]

    @staticmethod
    def storage_options(endpoint: str) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
                "AWS_FORCE_PATH_STYLE": "true"}

    def _ask(self, command: str) -> dict[str, int]:
        before = len(self.process.lines)
        self.process.send(command)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in self.process.lines[before:]:
                if line.startswith("counts "):
                    return json.loads(line[len("counts "):])
            time.sleep(0.02)
        raise RuntimeError("the S3 server did not answer")

    def reset(self) -> None:
        self._ask("reset")

    def counts(self) -> dict[str, int]:
        return self._ask("counts")

    def __enter__(self) -> CountingS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.close_stdin()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.proc.wait(timeout=30)
        self.process.stop()


def _request_kind(method: str, path: str, query: str) -> str:
    """"KIND PART" of an S3 request: a GET listing a prefix is a LIST; PART is log (a table's
    _delta_log), data, or bucket."""
    kind = "LIST" if method == "GET" and ("list-type=" in query or "prefix=" in query) else method
    part = "log" if "_delta_log" in path or "_delta_log" in query else ("data" if path.count("/") > 1 else "bucket")
    return f"{kind} {part}"


def s3_child(args: argparse.Namespace) -> int:
    """moto's S3 API on two ports of 127.0.0.1 (one backend, one bucket); counts the first port's
    requests; answers "counts" and "reset" on stdin, and stops when stdin closes."""
    import collections
    import logging

    import boto3
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = DomainDispatcherApplication(create_backend_app)
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def counted(environ: dict, start_response: Any) -> Any:
        kind = _request_kind(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", ""))

        def start(status: str, headers: Any, exc_info: Any = None) -> Any:
            with lock:
                counts[f"{kind} {status.split()[0]}"] += 1
            return start_response(status, headers, exc_info)

        return app(environ, start)

    servers = [make_server("127.0.0.1", 0, counted, True, request_handler=MotoRequestHandler),
               make_server("127.0.0.1", 0, app, True, request_handler=MotoRequestHandler)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    writers, others = (f"http://127.0.0.1:{server.server_address[1]}" for server in servers)
    boto3.client("s3", endpoint_url=others, region_name="us-east-1").create_bucket(Bucket=args.bucket)
    print("ready " + json.dumps({"writers": writers, "others": others}), flush=True)
    for line in sys.stdin:
        with lock:
            answer = dict(counts)
            if line.strip() == "reset":
                counts.clear()
        print("counts " + json.dumps(answer), flush=True)
    for server in servers:
        server.shutdown()
    return 0


# -- the children -----------------------------------------------------------------------------------------

def _go() -> bool:
    """Wait for the parent's "go" on stdin."""
    return sys.stdin.readline().strip() == "go"


def _stdin_closed(timeout_s: float) -> bool:
    readable, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout_s))
    return bool(readable) and not sys.stdin.readline()


def _records(run_id: str, layers: int, tokens: int, experts: int, count: int, seed: int) -> list[Any]:
    """`count` distinct StepRecords with routes (top-2 of `experts`), made before the clock starts."""
    import numpy as np

    from moescope.core.records import LayerStep, Routes, StepRecord

    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        layer_steps = []
        for layer in range(layers):
            first = rng.integers(0, experts, tokens)
            ids = np.stack([first, (first + 1 + rng.integers(0, experts - 1, tokens)) % experts], axis=1)
            weights = rng.dirichlet([1, 1], tokens).astype(np.float32)
            routes = Routes(expert_ids=ids.astype(np.int32), gate_weights=weights,
                            kept=np.ones((tokens, 2), bool), token_ids=rng.integers(0, 32_000, tokens),
                            sequence=(np.arange(tokens) // 256).astype(np.int32),
                            position=(np.arange(tokens) % 256).astype(np.int32))
            load = np.bincount(ids.reshape(-1), minlength=experts).astype(np.int64)
            layer_steps.append(LayerStep(
                layer=layer, tokens=tokens, expert_load=load, gate_weight_sum=load / 2.0, router_entropy_mean=2.0,
                router_entropy_p95=3.0, top1_margin_mean=0.1, dropped_tokens=0, dropped_assignments=0, capacity=None,
                capacity_use=None, active_params_per_token=1e6, router_prob_sum=np.full(experts, tokens / experts),
                routes=routes))
        records.append(StepRecord(run_id=run_id, step=0, ts=dt.datetime.now(dt.timezone.utc), duration_s=0.05,
                                  tokens=tokens, batch_size=max(1, tokens // 256), seq_len=256, active_params=1e7,
                                  total_params=10**8, tags={}, layers=layer_steps))
    return records


def writer_child(args: argparse.Namespace) -> int:
    """One writer: the probe's pipeline and ParquetExporter as `moescope.attach` makes them (default
    flush), fed synthetic records at `--rate` route rows/s (0: as fast as it takes them) for
    `--seconds` after the parent's "go"; prints its rows, commits and latencies as it exits."""
    from moescope.core.pipeline import BatchProcessor
    from moescope.core.records import LayerInfo, RunInfo
    from moescope.core.runs import current_host
    from moescope.probe import Pipeline
    from moescope.store import delta
    from moescope.store.writer import ParquetExporter

    commit_s: list[float] = []
    upload_s: list[float] = []
    commit, write_part = delta.commit, delta.write_part

    def timed_commit(*a: Any, **k: Any) -> int:
        started = time.perf_counter()
        try:
            return commit(*a, **k)
        finally:
            commit_s.append(time.perf_counter() - started)

    def timed_write_part(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return write_part(*a, **k)
        finally:
            upload_s.append(time.perf_counter() - started)

    delta.commit, delta.write_part = timed_commit, timed_write_part  # the writer calls them through the module

    run_id, rank = os.environ["MOESCOPE_RUN_ID"], int(os.environ["RANK"])
    run = RunInfo(run_id=run_id, started_at=dt.datetime.now(dt.timezone.utc), model_class="FleetBench",
                  total_params=10**8, routed_expert_params=9 * 10**7, tags={}, rank=rank,
                  world_size=int(os.environ["WORLD_SIZE"]),
                  layers=tuple(LayerInfo(layer=i, module=f"layers.{i}.moe", family="synthetic",
                                         num_experts=args.experts, top_k=2, params_per_expert=10**6)
                               for i in range(args.layers)))
    pool = _records(run_id, args.layers, args.tokens, args.experts, count=8, seed=rank)
    defaults = Pipeline()
    processor = BatchProcessor([], max_queue=defaults.max_queue, policy=defaults.policy,
                               flush_interval_s=defaults.flush_interval_s, max_queue_bytes=defaults.max_queue_bytes)
    exporter = ParquetExporter(args.store, run, max_age_s=defaults.flush_interval_s, processor=processor,
                               storage_options=args.storage_option or None)
    processor.add_exporter(exporter)
    print("ready", flush=True)
    if not _go():
        processor.shutdown()
        return 1
    rows_per_record = args.layers * args.tokens
    interval = rows_per_record / args.rate if args.rate > 0 else 0.0
    started = time.monotonic()
    deadline = started + args.seconds
    due = started
    step = 0
    while time.monotonic() < deadline:
        template = pool[step % len(pool)]
        processor.emit(dataclasses.replace(template, step=step, ts=dt.datetime.now(dt.timezone.utc)))
        step += 1
        if interval:
            due += interval
            time.sleep(max(0.0, due - time.monotonic()))
    emit_seconds = time.monotonic() - started
    processor.shutdown()  # drains: the last flush and the final probe_stats are in the time
    seconds = time.monotonic() - started
    dropped = {f"{t}/{r}": n for (t, r), n in processor.dropped_rows.items()}
    print("result " + json.dumps({
        "rank": rank, "host": current_host(), "routes_rows": exporter.written_rows.get("routes", 0),
        "written": dict(exporter.written_rows), "seconds": seconds, "emit_seconds": emit_seconds, "steps": step,
        "commits": len(commit_s),
        "commit_s": commit_s, "upload_s": upload_s, "dropped": dropped}), flush=True)
    return 0


def _event(kind: str, started: float, **fields: Any) -> None:
    print(f"{kind} " + json.dumps({"seconds": time.monotonic() - started, **fields}), flush=True)


def compactor_child(args: argparse.Namespace) -> int:
    """Compact the run every `--every` seconds from "go" until stdin closes; prints a line per run
    of compact (its time, whether it merged files, its error)."""
    from moescope.store.compact import compact

    print("ready", flush=True)
    if not _go():
        return 1
    while True:
        started = time.monotonic()
        try:
            results = compact(args.store, run_id=args.run, storage_options=args.storage_option or None)
            _event("compact", started, merged=any(r.merged_files for r in results), error=None)
        except Exception as e:  # noqa: BLE001 - reported, the loop goes on
            _event("compact", started, merged=False, error=f"{type(e).__name__}: {e}")
        if _stdin_closed(args.every):
            return 0


def reader_child(args: argparse.Namespace) -> int:
    """Query the run in a loop from "go" until stdin closes (a Store refreshed, route rows per
    layer); prints a line per query (its time, its error)."""
    from moescope.store import Store

    print("ready", flush=True)
    if not _go():
        return 1
    store = None
    while not _stdin_closed(0.0):
        started = time.monotonic()
        try:
            if store is None:
                store = Store(args.store, storage_options=args.storage_option or None)
            store.refresh()
            store.sql("SELECT layer, count(*) AS n FROM routes WHERE run_id = ? GROUP BY layer", [args.run])
            _event("query", started, error=None)
        except Exception as e:  # noqa: BLE001 - reported, the loop goes on
            _event("query", started, error=f"{type(e).__name__}: {e}")
            time.sleep(0.5)
    return 0


def helper_summary(process: Process, event: str, stopped_at: float) -> dict[str, Any]:
    """What a compactor or reader did, from its event lines; `unfinished_s`: how long the call it
    was in when it had to be stopped had run (0 when it stopped by itself)."""
    events = [json.loads(line[len(event) + 1:]) for line in process.lines if line.startswith(event + " ")]
    return {"runs": len(events), "seconds": [e["seconds"] for e in events],
            "merged": sum(bool(e.get("merged")) for e in events),
            "errors": [e["error"] for e in events if e["error"]][:5],
            "error_count": sum(bool(e["error"]) for e in events),
            "unfinished_s": max(0.0, stopped_at - process.last_line_at) if process.proc.returncode else 0.0}


# -- the command line ----------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", help="where to write: a local folder, or s3://BUCKET/PREFIX (default: moto's S3 "
                                   "server, started here, and a fresh prefix of its bucket)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option to reach an S3 store (repeatable): endpoint=..., region=..., allow_http=true; "
                        "credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    p.add_argument("--writers", type=int, default=8, help="writer processes (default 8)")
    p.add_argument("--hosts", type=int, default=4, help="host names they are spread over (default 4)")
    p.add_argument("--seconds", type=float, default=45.0, help="how long each phase's writers emit (default 45)")
    p.add_argument("--phases", default="saturated,paced", help="which phases, comma-separated (default both)")
    p.add_argument("--rate", type=float, default=20_000, help="route rows/s per writer in the paced phase "
                                                              "(default 20000)")
    p.add_argument("--layers", type=int, default=8, help="MoE layers per record (default 8)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per record and layer (default 512)")
    p.add_argument("--experts", type=int, default=64, help="experts per layer, top-2 routing (default 64)")
    p.add_argument("--compact-every", type=float, default=10.0, help="seconds between compactions (0: none)")
    p.add_argument("--no-reader", dest="reader", action="store_false", help="no reader querying in a loop")
    p.add_argument("--helper-grace", type=float, default=60.0,
                   help="seconds the compactor and the reader get to finish the call they are in once the writers "
                        "are done, before they are stopped (default 60)")
    p.add_argument("--count-requests", action="store_true",
                   help="with --store s3://... over plain http: count the writers' requests through a proxy "
                        "(by HTTP method; it adds latency). Without --store they are always counted")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    p.add_argument("--child", choices=("writer", "compactor", "reader", "s3"), help=argparse.SUPPRESS)
    p.add_argument("--bucket", default=CountingS3.bucket, help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--every", type=float, default=10.0, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    if args.child:
        children = {"writer": writer_child, "compactor": compactor_child, "reader": reader_child, "s3": s3_child}
        sys.exit(children[args.child](args))
    if args.writers < 1 or args.hosts < 1 or args.hosts > args.writers:
        raise SystemExit("bench/fleet.py: give --writers >= --hosts >= 1")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - {"saturated", "paced"}
    if unknown or not phases:
        raise SystemExit(f"bench/fleet.py: --phases takes saturated and/or paced, not {', '.join(sorted(unknown))}")
    results = []
    with store_setup(args) as setup:
        print(f"fleet: {args.writers} writers on {args.hosts} hosts into {setup.where}; records of {args.layers} "
              f"layers x {args.tokens} tokens (top-2 of {args.experts}); moescope's default flush", flush=True)
        for phase in phases:
            out = run_phase(setup, args, phase, 0.0 if phase == "saturated" else args.rate)
            print(report(out, setup, args), flush=True)
            if args.json:
                print(json.dumps(out, default=str), flush=True)
            results.append(out)
    return results


if __name__ == "__main__":
    main()
