"""Scale-out glue (the optional `ray` extra, imported only when asked for): store shards built in
fresh processes or Ray tasks, corpora tokenized and records generated with Ray Data actors.

A shard job runs in a fresh process that memory-maps only its slice of the tokens file, so its
peak memory (which it reports) is its own shard's. A generate actor turns a record into its output
line exactly as the local batch does (samctl.records.RecordRunner), in input order. Not in index/
or decode/: they never import ray.
"""
from __future__ import annotations

import atexit
import contextlib
import concurrent.futures
import json
import logging
import multiprocessing
import os
import pickle
import resource
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from samctl.index.datastore import StoreMeta
from samctl.index.errors import UserError
from samctl.index.sharded import build_shard

if TYPE_CHECKING:
    from samctl.session import SessionConfig

LOCAL = "local"  # --ray without an address: start a local Ray instance
CHUNK_CHARS = 1 << 20  # characters of documents per Ray Data row when tokenizing


def import_ray():
    try:
        import ray
    except ImportError as err:
        raise UserError("--ray needs Ray: pip install 'samctl[ray]' (or pip install 'ray[data]')") from err
    return ray


def start_ray(address: str, num_cpus: int | None = None, object_store_mb: int = 1024):
    """Connect to the cluster at `address` (samctl installed on every node, stores on a filesystem
    every node sees), or for LOCAL start an instance whose workers run this process's code
    (PYTHONPATH), with no dashboard and a small object store."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    logging.getLogger("ray").setLevel(logging.WARNING)  # stderr is for samctl's own progress
    if address == LOCAL:
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        # Ray's note on token authentication addresses the instance's operator: samctl, not the user
        logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 object_store_memory=object_store_mb << 20, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        atexit.register(stop_local_ray, ray)  # runs before Ray's own exit hook (registered earlier)
    else:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise UserError(f"cannot reach the Ray cluster at {address} ({str(err).splitlines()[0][:160]}): "
                            "start it with `ray start --head` and pass its address, or --ray alone "
                            "for a local instance") from err
    return ray


def stop_local_ray(ray) -> None:
    """Shut the local instance down, killing its processes still there after a few seconds: a worker
    only notices on its own, tens of seconds later, that its raylet is gone."""
    try:
        import psutil
    except ImportError:  # Ray's own shutdown, without the wait
        ray.shutdown()
        return
    children = [p for p in psutil.Process().children(recursive=True) if _is_ray(p)]
    ray.shutdown()
    _, alive = psutil.wait_procs(children, timeout=3)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=3)


def _is_ray(process) -> bool:
    try:
        return any("ray" in part or "gcs_server" in part for part in process.cmdline())
    except Exception:  # gone, or not ours to read: nothing to wait for
        return False


def _unwrap(err: BaseException) -> BaseException:
    """The UserError a Ray task raised (wrapped by Ray), for the CLI's one-line boundary; else `err`."""
    seen, current = 0, err
    while current is not None and seen < 10:
        if isinstance(current, UserError):
            return current
        current = getattr(current, "cause", None) or current.__cause__
        seen += 1
    return err


def _map_actors(dataset, cls: type, args: tuple, workers: int, batch_size: int = 1, **resources: Any):
    """dataset.map_batches over `workers` actors of `cls`. max_restarts=0: a dying worker fails the
    run with its error, and Ray logs no error-level line about restarting actors (ray#53727). Ray
    2.60 takes it only through its deprecated ray_remote_args, a warning meant for samctl."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated", category=DeprecationWarning)
        return dataset.map_batches(cls, fn_constructor_args=args, batch_size=batch_size,
                                   compute=import_ray().data.ActorPoolStrategy(size=workers), max_restarts=0,
                                   **resources)


def _data_context(ray):
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.print_on_execution_start = False
    # its progress lines, and the traceback it logs before raising a worker's error, which
    # samctl turns into one line when it is a UserError and re-raises otherwise
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)
    context.enable_progress_bars = False
    return context


# -- building shards --------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardJob:
    """One shard to build: documents [doc_lo, doc_hi) of the tokens file."""

    index: int
    path: str
    tokens_file: str  # a .npy of all the corpus's int32 tokens
    offsets: np.ndarray  # [d+1] int64, the shard's document offsets into the tokens file
    meta: StoreMeta  # the whole store's (its kind is the shard's)
    memory_limit: int | None = None  # bytes this shard's suffix sort may hold (sa)


def build_shard_job(job: ShardJob) -> tuple[int, dict[str, Any], int, dict[str, int]]:
    """(index, entry, peak bytes, counts) of the shard built from its slice of the tokens file."""
    lo, hi = int(job.offsets[0]), int(job.offsets[-1])
    mapped = np.load(job.tokens_file, mmap_mode="r")
    tokens = np.array(mapped[lo:hi])
    del mapped  # unmapped: its pages leave this process's resident set
    entry, counts = build_shard(job.path, tokens, job.offsets - lo, job.meta, job.memory_limit)
    return job.index, entry, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, counts  # Linux: in kB


def shard_jobs(tmp: Path, tokens: np.ndarray, doc_offsets: np.ndarray, bounds: np.ndarray, meta: StoreMeta,
               shard_path: Callable[[int], Path], memory_limit: int | None = None) -> list[ShardJob]:
    """Write tokens ([n] int32) into tmp once; one job per shard (bounds: [N+1] document indices)."""
    tokens_file = tmp / "tokens.npy"
    np.save(tokens_file, np.ascontiguousarray(tokens, dtype=np.int32))
    return [ShardJob(i, str(shard_path(i)), str(tokens_file), doc_offsets[bounds[i]:bounds[i + 1] + 1].copy(), meta,
                     memory_limit) for i in range(len(bounds) - 1)]


ShardResult = tuple[dict[str, Any], int, dict[str, int]]  # (manifest entry, worker peak bytes, counts)


def run_local(jobs: list[ShardJob], workers: int, on_done: Callable[[int, int], None]) -> list[ShardResult]:
    """Each job in a fresh spawned process, `workers` at a time; results in shard order."""
    results: dict[int, ShardResult] = {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context,
                                                max_tasks_per_child=1) as pool:
        for future in concurrent.futures.as_completed([pool.submit(build_shard_job, job) for job in jobs]):
            index, entry, peak, counts = future.result()
            results[index] = (entry, peak, counts)
            on_done(index, peak)
    return [results[i] for i in range(len(jobs))]


def run_on_ray(address: str, jobs: list[ShardJob], on_done: Callable[[int, int], None]) -> list[ShardResult]:
    """Each job as a Ray task (one CPU, a fresh worker process each); results as run_local's."""
    ray = start_ray(address)
    task = ray.remote(num_cpus=1, max_calls=1)(build_shard_job)
    pending = {task.remote(job): job.index for job in jobs}
    results: dict[int, ShardResult] = {}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        try:
            index, entry, peak, counts = ray.get(done[0])
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from err
        del pending[done[0]]
        results[index] = (entry, peak, counts)
        on_done(index, peak)
    return [results[i] for i in range(len(jobs))]


# -- tokenizing on Ray Data -------------------------------------------------------------------


class _Tokenize:
    def __init__(self, tokenizer_spec: str | None, append_eos: bool) -> None:
        from samctl.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_spec)  # the driver said which
        self.append_eos = append_eos

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from samctl.tokenizer import tokenize_documents

        tokens, lengths = [], []
        for docs in batch["docs"]:
            ids, offsets = tokenize_documents(list(docs), self.tokenizer, append_eos=self.append_eos)
            tokens.append(ids.tobytes())
            lengths.append(np.diff(offsets).tobytes())
        return {"chunk": batch["chunk"], "tokens": np.array(tokens, dtype=object),
                "lengths": np.array(lengths, dtype=object)}


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def tokenize_on_ray(address: str, texts: Iterable[str], tokenizer_spec: str | None, append_eos: bool,
                    on_tokens: Callable[[int, int], None]) -> tuple[np.ndarray, np.ndarray]:
    """tokenize_documents on the cluster: (tokens [n] int32, doc_offsets [d+1] int64), in order;
    on_tokens(documents, tokens) after each chunk. A corpus of one chunk (under CHUNK_CHARS) is
    tokenized here: starting tokenizer actors costs more than it saves."""
    items = [{"chunk": i, "docs": chunk} for i, chunk in enumerate(_chunks(texts))]
    if not items:
        return np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64)
    if len(items) == 1:
        out = _Tokenize(tokenizer_spec, append_eos)({"chunk": np.array([0]), "docs": [items[0]["docs"]]})
        rows: Iterable[dict[str, Any]] = [{"tokens": out["tokens"][0], "lengths": out["lengths"][0]}]
        return _joined(rows, on_tokens)
    ray = start_ray(address)
    _data_context(ray)
    workers = max(1, min(len(items), int(ray.cluster_resources().get("CPU", 1))))
    dataset = _map_actors(ray.data.from_items(items, override_num_blocks=len(items)), _Tokenize,
                          (tokenizer_spec, append_eos), workers, num_cpus=1)
    try:
        return _joined(dataset.iter_rows(), on_tokens)
    except Exception as err:  # Ray Data wraps a worker's error in its own types
        unwrapped = _unwrap(err)
        if unwrapped is err:
            raise
        raise unwrapped from err


def _joined(rows: Iterable[dict[str, Any]], on_tokens: Callable[[int, int], None]) -> tuple[np.ndarray, np.ndarray]:
    tokens, lengths = [], []
    for row in rows:
        tokens.append(np.frombuffer(row["tokens"], dtype=np.int32))
        lengths.append(np.frombuffer(row["lengths"], dtype=np.int64))
        on_tokens(len(lengths[-1]), len(tokens[-1]))
    return np.concatenate(tokens), np.concatenate(([0], np.cumsum(np.concatenate(lengths)))).astype(np.int64)


# -- batch generation on Ray Data -------------------------------------------------------------


class _GenerateWorker:
    """Ray Data actor: one Session for the actor's life; input lines -> output lines and failures."""

    def __init__(self, config: "SessionConfig", field: str | None, compare: bool, batch_size: int = 1) -> None:
        from samctl.records import RecordRunner
        from samctl.session import Session

        # A UserError goes back pickled in every row's `fatal` column: Ray would hand the driver the
        # exception without its type, and a ConfigError's type words its settings as flags.
        self.fatal = b""
        try:
            self.runner = RecordRunner(Session(config), field=field, compare=compare, batch_size=batch_size)
        except UserError as err:
            self.fatal = pickle.dumps(err)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        lines: list[str] = []  # in input order
        if self.fatal:
            lines += [""] * len(batch["number"])
        else:
            self.runner.batch([(int(number), str(line)) for number, line in zip(batch["number"], batch["line"])],
                              lines.append, quiet=True)
        failed = [bool(self.fatal) or "error" in json.loads(line) for line in lines]
        return {"number": batch["number"], "out": np.array(lines, dtype=object), "failed": np.array(failed, dtype=bool),
                "fatal": np.array([self.fatal] * len(lines), dtype=object)}


def _worker_count(ray, requested: int | None, threads: int, gpus: float) -> int:
    if requested is not None:
        return requested
    resources = ray.cluster_resources()
    if gpus > 0:
        return max(1, int(resources.get("GPU", 0) // gpus))
    return max(1, int(resources.get("CPU", 1) // threads))


def generate_on_ray(config: "SessionConfig", records: Iterable[tuple[int, str]], write: Callable[[str], None], *,
                    address: str, workers: int | None = None, gpus_per_worker: float = 0.0, field: str | None = None,
                    compare: bool = False, batch_size: int = 1) -> int:
    """`generate --input` on Ray: writes each output line in input order; returns the failures."""
    from samctl.progress import progress_bar

    threads = config.threads or 1
    quiet, config = config.quiet, replace(config, threads=threads, quiet=True)
    items = [{"number": number, "line": line} for number, line in records]
    if not items:
        return 0
    local_cpus = None
    if address == LOCAL and workers is not None:
        local_cpus = max(os.cpu_count() or 1, workers * threads)  # room for every actor asked for
    ray = start_ray(address, num_cpus=local_cpus)
    _data_context(ray)
    workers = min(len(items), _worker_count(ray, workers, threads, gpus_per_worker))
    # Small blocks spread the records over the actors and let finished ones stream out in order.
    dataset = _map_actors(ray.data.from_items(items, override_num_blocks=min(len(items), 32 * workers)),
                          _GenerateWorker, (config, field, compare, batch_size), workers,
                          batch_size=batch_size, num_cpus=threads, num_gpus=gpus_per_worker or None)
    failed = 0
    try:
        with progress_bar(f"generate on {workers} Ray worker(s)", "record", quiet, total=len(items)) as bar:
            for row in dataset.iter_rows():
                if row["fatal"]:
                    raise pickle.loads(row["fatal"])
                write(row["out"])
                failed += bool(row["failed"])
                bar.update(1)
    except ray.exceptions.RayError as err:
        raise _unwrap(err) from err
    return failed
