"""The walk of one trajectory, from `rollout()` to the adapter that serves the step it trained.

Starts art-server on the embedded model in this process (uvicorn in a thread), registers a run,
then traces on every thread one group of demo rollouts through the client library, its training
job (on the server's trainer thread) and one request to `run@step`: how often control enters each
run-related module from outside that set, how many functions return inside it, and how many
distinct functions of this repository run; and the same walk as a reader follows it, each function
read once (`read`: its doors into the run's modules, its moves between modules and the returns
among them, as one counts by reading the code). `python bench/trajectory_walk.py`;
one JSON line. `--baseline REV` walks the same way at another commit too (a git worktree, in a
process of its own), so a figure set against an older one compares like with like: `make bench-walk`
measures against the commit issue 35 counted (`WALK_BASELINE`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dis
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the trainer and the engine share 2 cores with the client
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _load_names():
    """This checkout's protocol/names.py (the `run@N` grammar), loaded by its path under a name of its
    own: a baseline walks an older checkout's packages, which may predate that module, and importing
    `protocol` from here would hand the older server this checkout's package."""
    spec = importlib.util.spec_from_file_location("walk_names", ROOT / "protocol" / "names.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


names = _load_names()  # before any walk: loading it is not part of one

# The modules that hold a run's state: its registry, checkpoints, leases, pins and served steps
# (server/runs), its rows (store/runs, store/steps), the commit of its next step, and the table
# of served names a step is published into. A trajectory should cross into them at a few doors;
# each further entry is one more place outside them that must know how a run works.
RUN_RELATED = ("server.runs", "server.store.runs", "server.store.steps", "server.training.commit",
               "server.sampling.served_names")
GROUP_SIZE = 2  # the smallest group that can train: the walk of one trajectory and its one peer
MAX_TOKENS = 24
RUN = "walk"
NO_CALLER = "(a thread's start or a library)"  # e.g. asyncio.to_thread: the stack of ours ends at the hop
HOW = ("sys/threading.setprofile on all threads from the first rollout() to run@step's reply, frames of this "
       "repository only (not .venv, not this script): an entry is a run-related function starting whose nearest "
       "calling frame of ours is outside the set (or absent: a thread hop or library), run_returns counts "
       "run-related functions leaving (return or raise, not yield), functions the distinct functions of ours run; "
       "read: the same trace as a reader follows it (read_walk): each function once (its nested comprehensions, "
       "lambdas and closures with it), doors the run-related "
       "functions first started from outside the set, moves and returns between modules on each thread's path, "
       "and the returns left on that path were each package one module, or each top-level package; "
       "baseline: the same walk at --baseline's commit (a git worktree, walked in a process of its own), only its "
       "figures that do not depend on module names")


class Event(NamedTuple):
    kind: str  # "call": a function started; "return": it left
    module: str
    function: str  # module:qualname
    caller: str | None = None  # a call's nearest module of ours up the stack
    thread: int = 0  # the thread it ran on


def run_related(module: str | None, related: Iterable[str] = RUN_RELATED) -> bool:
    return module is not None and any(module == r or module.startswith(r + ".") for r in related)


def count_walk(events: Iterable[Event], related: Iterable[str] = RUN_RELATED) -> dict:
    """Entries into each run-related module from outside the set (and from where), returns inside
    the set, and distinct functions started: pure, so the rule is tested apart from the tracing."""
    related, entries, sources = tuple(related), Counter(), defaultdict(Counter)
    returns, functions = 0, set()
    for e in events:
        inside = run_related(e.module, related)
        if e.kind == "call":
            functions.add(e.function)
            if inside and not run_related(e.caller, related):
                entries[e.module] += 1
                sources[e.module][e.caller or NO_CALLER] += 1
        elif inside:
            returns += 1
    return {"entries": dict(entries.most_common()), "max_entries": max(entries.values(), default=0),
            "run_returns": returns, "functions": len(functions),
            "entered_from": {m: dict(sources[m].most_common()) for m, _ in entries.most_common()}}


def read_walk(events: Iterable[Event], related: Iterable[str] = RUN_RELATED, root: Path = ROOT) -> dict:
    """The walk as a reader follows it, the way the issue counted by reading the code: each function
    of ours read once, at the first time the run starts it. Its doors: the run-related functions
    first started from outside the set (the places outside that must know how a run works; a
    request that comes again through the same door is not another). Its moves, on each thread's
    path: the next function read being in another module; a return is a move into a module that
    path has already left. A function's comprehensions, lambdas and closures are read with it: Python
    3.11 runs them as code objects of their own (3.12 inlines comprehensions), and counted apart they
    made a return of every comprehension that ran after a call into another module."""
    related, seen, paths = tuple(related), set(), defaultdict(list)
    doors: Counter[str] = Counter()
    for e in events:
        function = outermost(e.function)
        if e.kind == "call" and function not in seen:
            seen.add(function)
            paths[e.thread].append(e.module)
            if run_related(e.module, related) and not run_related(e.caller, related):
                doors[e.module] += 1
    moves, returns, run_returns = walk_moves(paths.values(), related)
    # Per function read: a walk that runs more code has more to return to, however the code is laid out.
    # The same path with every package read as one module, then every top-level package: the returns
    # no layout of modules inside the packages (or of the packages) could take away.
    by_package = [[package_of(m, root) for m in path] for path in paths.values()]
    by_top = [[m.partition(".")[0] for m in path] for path in paths.values()]
    return {"doors": dict(doors.most_common()), "max_doors": max(doors.values(), default=0),
            "moves": moves, "returns": returns, "run_returns": run_returns,
            "modules": len({m for path in paths.values() for m in path}), "functions": len(seen),
            "returns_per_function": round(returns / max(len(seen), 1), 3),
            "returns_one_module_per_package": walk_moves(by_package, related)[1],
            "returns_one_module_per_top_package": walk_moves(by_top, related)[1]}


def walk_moves(paths: Iterable[list[str]], related: Iterable[str] = RUN_RELATED) -> tuple[int, int, int]:
    """(moves, returns, run-related returns) along each path: a move is a step into another
    module, a return a move into a module that path has already left."""
    moves = returns = run_returns = 0
    for path in paths:
        left: set[str] = set()
        for here, there in zip(path, path[1:]):
            if here == there:
                continue
            moves += 1
            left.add(here)
            if there in left:
                returns += 1
                run_returns += run_related(there, related)
    return moves, returns, run_returns


@functools.cache
def package_of(module: str, root: Path = ROOT) -> str:
    """The package a module of the walked repository belongs to: a package's own __init__ belongs to itself."""
    parts = module.split(".")
    return module if root.joinpath(*parts).is_dir() or len(parts) == 1 else ".".join(parts[:-1])


def outermost(function: str) -> str:
    """`module:f` for `module:f.<locals>.<listcomp>` and any other code nested in f's text."""
    return function.split(".<locals>.", 1)[0]


@functools.cache
def module_of(filename: str, root: Path = ROOT) -> str | None:
    """The dotted name of a module of the walked repository; None for .venv, the standard library, this script."""
    path = Path(filename)
    if not path.is_relative_to(root) or path.suffix != ".py" or path == Path(__file__).resolve():
        return None
    parts = path.relative_to(root).with_suffix("").parts
    if parts[0].startswith("."):  # .venv and other hidden trees
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


RESUME, YIELD_VALUE = dis.opmap["RESUME"], dis.opmap["YIELD_VALUE"]


def starts(frame) -> bool:
    """A 'call' event that begins a function (RESUME 0), not a generator or coroutine resumed."""
    code = frame.f_code.co_code
    return code[frame.f_lasti] == RESUME and code[frame.f_lasti + 1] == 0


def leaves(frame) -> bool:
    """A 'return' event that ends a function (a return or an exception), not a yield or an await."""
    return frame.f_code.co_code[frame.f_lasti] != YIELD_VALUE


class Tracer:
    """A profile hook on every thread (installed before the server starts its threads), recording
    only while `active`: the server's start-up and the run's registration are not the walk."""

    def __init__(self, root: Path = ROOT) -> None:
        self.events: list[Event] = []
        self.active = False
        self.root = root

    def caller(self, frame) -> str | None:
        while frame is not None:
            module = module_of(frame.f_code.co_filename, self.root)
            if module is not None:
                return module
            frame = frame.f_back
        return None

    def profile(self, frame, event: str, arg) -> None:
        if not self.active or event[:2] == "c_":  # a builtin's call or return: never ours
            return
        module = module_of(frame.f_code.co_filename, self.root)
        if module is None:
            return
        function = f"{module}:{frame.f_code.co_qualname}"
        if event == "call" and starts(frame):
            self.events.append(Event("call", module, function, self.caller(frame.f_back), threading.get_ident()))
        elif event == "return" and leaves(frame):
            self.events.append(Event("return", module, function, thread=threading.get_ident()))

    @contextlib.contextmanager
    def installed(self) -> Iterator["Tracer"]:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            self.active = False


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` served by uvicorn in a thread of this process, on a free loopback port."""
    import uvicorn

    from client.local_server import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server stopped during start-up")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def break_tie(trajectories: list) -> list:
    """A group whose rewards tie trains nothing, and a walk that stops short of a step measures
    nothing: a tie is broken by hand (the demo's untrained model often fails every rollout)."""
    if len({t.reward for t in trajectories}) > 1:
        return trajectories
    return [t.model_copy(update={"reward": float(i % 2)}) for i, t in enumerate(trajectories)]


async def walk(url: str, tracer: Tracer) -> dict:
    from client.gather import gather_trajectory_groups
    from client.model import TrainableModel
    from examples.demo import make_example
    from protocol.trajectory import TrajectoryGroup
    from rollouts.agent import rollout

    example = make_example()
    task = example.train_tasks(0)[0]
    settings = replace(example.settings, max_tokens=MAX_TOKENS)
    model = await TrainableModel(RUN).register(url)  # before the walk: a run exists before its first rollout
    async with model.openai_client(max_retries=0) as client:
        tracer.active = True
        try:
            rollouts = [rollout(client, model.name, example.make_env(task), task, replace(settings, seed=i))
                        for i in range(GROUP_SIZE)]
            [group] = await gather_trajectory_groups([rollouts], progress=False)
            result = await model.train([TrajectoryGroup(trajectories=break_tie(group.trajectories))])
            if not result.trained:
                raise RuntimeError(f"the step did not train: {result.warnings}")
            served = names.policy_name(model.name, result.step)
            await client.chat.completions.create(model=served, max_tokens=MAX_TOKENS,
                                                 messages=example.make_env(task).initial_messages())
        finally:
            tracer.active = False
    return {"group_size": GROUP_SIZE, "turns": sum(t.metrics["turns"] for t in group.trajectories),
            "step": result.step}


def measure(root: Path = ROOT) -> dict:
    """The walk of the repository at `root`, whose packages this process imports."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-walk-") as work, Tracer(root).installed() as tracer:
        from server.app import create_app
        from server.settings import Settings

        if not Path(sys.modules["server"].__file__).is_relative_to(root):  # sys.path put another checkout first
            raise RuntimeError(f"the walk of {root} imported {sys.modules['server'].__file__}")
        app = create_app(Settings(data_dir=Path(work) / "data", device="cpu"))
        with serving(app) as url:
            walked = asyncio.run(walk(url, tracer))
    return {**count_walk(tracer.events), "read": read_walk(tracer.events, root=root), **walked,
            "seconds": round(time.perf_counter() - started, 1)}


def git(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=check)


def commit_of(rev: str) -> str:
    found = git("rev-parse", "--short", "--verify", "--quiet", rev + "^{commit}", check=False)
    if found.returncode:
        raise SystemExit(f"error: --baseline {rev}: no such commit in {ROOT}")
    return found.stdout.strip()


def measure_at(commit: str) -> dict:
    """The walk at `commit` of this repository: a worktree of it, walked by this script in a
    process of its own (one process cannot import two versions of the same packages)."""
    with tempfile.TemporaryDirectory(prefix="bench-walk-baseline-") as scratch:
        tree = Path(scratch) / "tree"
        git("worktree", "add", "--detach", "--quiet", str(tree), commit)
        try:
            done = subprocess.run([sys.executable, __file__, "--root", str(tree)], capture_output=True, text=True)
        finally:
            git("worktree", "remove", "--force", str(tree))
    if done.returncode:
        raise SystemExit(f"error: the walk at {commit} failed: {(done.stderr.strip().splitlines() or [''])[-1]}")
    return {"rev": commit, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="REV", help="also walk this git revision, the same way")
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)  # the checkout measure_at walks
    args = parser.parse_args(argv)
    if args.root is not None:
        root = args.root.resolve()
        sys.path.insert(0, str(root))
        print(json.dumps(measure(root)))
        return
    baseline = commit_of(args.baseline) if args.baseline else None
    line = {"bench": "trajectory_walk", **measure()}
    if baseline:
        # Only what does not depend on module names: an older commit kept a run's state in other modules.
        base = measure_at(baseline)
        line["baseline"] = {"rev": base["rev"], **{k: base["read"].get(k) for k in (
            "moves", "returns", "modules", "functions", "returns_per_function", "returns_one_module_per_package",
            "returns_one_module_per_top_package")}}
        line["returns_vs_baseline"] = round(line["read"]["returns"] / max(base["read"]["returns"], 1), 2)
    print(json.dumps({**line, "how": HOW}))


if __name__ == "__main__":
    main()
