"""OpenMP's wait policy and a one-row decode step on 2 threads: why few rows decode on one.

A CPU decode step of one row multiplies one row by every weight: SmolLM2-135M's 210 layer products
(random weights of its shapes: the time depends on the shapes, not on the values), each 0.1-0.2 ms.
On two threads every product ends at a barrier and the next wakes the second thread. Each case
runs in a process of its own, since libgomp (torch's OpenMP on Linux) reads its policy once, when
torch loads; within a case, passes on 1 thread (the baseline) and on 2 alternate:

- `passive`: `OMP_WAIT_POLICY=PASSIVE`, art-server's. A waiting thread sleeps at once.
- `spin`: the same with `GOMP_SPINCOUNT`: a waiting thread busy-waits that many turns, then sleeps.
- `spin_team_alive`: `spin` while another thread of the process holds an OpenMP team, as
  art-server's trainer thread does once it has trained. libgomp stops every thread's spinning once
  its live threads outnumber the cores (under PASSIVE its throttled spin count is 0).
- `spin_beside_busy`: `spin` while other processes keep all cores but one busy, as a client or a
  test beside the server may. A spinning thread holds a core another process needs.

    python bench/omp_wait.py          # `make bench-omp-wait`; prints one JSON line last
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

SPIN_COUNT = 10_000  # where the spin's gain levelled off here (3,000 gave less, 30,000 no more)
# SmolLM2-135M's linear layers as (in, out): q, k, v, o, gate, up, down; 30 of each.
LAYER = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))
LAYERS, PASSES, ROUNDS = 30, 10, 3
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}  # art-server's
SPINNING = {**PASSIVE, "GOMP_SPINCOUNT": str(SPIN_COUNT)}
CASES = {"passive": PASSIVE, "spin": SPINNING, "spin_team_alive": SPINNING, "spin_beside_busy": SPINNING}


def measure(layers: int, passes: int, rounds: int, team_alive: bool) -> dict:
    """Milliseconds per one-row pass over `layers` layers on 1 and on 2 threads (median of rounds)."""
    import torch

    weights = [torch.randn(n_in, n_out) for _ in range(layers) for n_in, n_out in LAYER]
    rows = {n_in: torch.randn(1, n_in) for n_in, _ in LAYER}
    release = threading.Event()

    def hold_a_team() -> None:  # on the worker's OMP_NUM_THREADS=2, as every thread of it starts
        a = torch.randn(512, 512)
        a @ a
        release.wait()

    # a thread that has run a parallel region and lives on, as the trainer does
    trainer = threading.Thread(target=hold_a_team) if team_alive else None
    if trainer is not None:
        trainer.start()
        time.sleep(0.2)
    times: dict[int, list[float]] = {1: [], 2: []}
    try:
        for _ in range(rounds):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for w in weights[:7]:  # warm-up: this thread's team, the caches
                    rows[w.shape[0]] @ w
                started = time.perf_counter()
                for _ in range(passes):
                    for w in weights:
                        rows[w.shape[0]] @ w
                times[threads].append(1000 * (time.perf_counter() - started) / passes)
    finally:
        # Joined, not left to die with the process: the interpreter exiting while that thread's
        # OpenMP team still runs aborts the process now and then (SIGABRT).
        release.set()
        if trainer is not None:
            trainer.join()
    return {f"t{n}_ms": round(statistics.median(v), 2) for n, v in times.items()}


def run_case(case: str, layers: int, passes: int, rounds: int) -> dict:
    """One case in a fresh process (with busy processes beside it for `spin_beside_busy`)."""
    env = {**os.environ, **CASES[case], "OMP_NUM_THREADS": "2"}
    busy = []
    if case == "spin_beside_busy":
        spin = "import time\nend = time.time() + 600\nwhile time.time() < end: pass"
        busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(max(1, (os.cpu_count() or 2) - 1))]
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", case, "--layers", str(layers),
                              "--passes", str(passes), "--rounds", str(rounds)],
                             env=env, capture_output=True, text=True, check=True, timeout=600)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(cases: dict[str, dict]) -> dict:
    """Each case's times and 2 threads' speed-up over 1 (above 1: the second thread pays)."""
    return {case: {**t, "two_threads_speedup": round(t["t1_ms"] / t["t2_ms"], 3)} for case, t in cases.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--passes", type=int, default=PASSES)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(measure(a.layers, a.passes, a.rounds, team_alive=a.worker == "spin_team_alive")))
        return
    cases = {case: run_case(case, a.layers, a.passes, a.rounds) for case in CASES}
    print(json.dumps({"bench": "omp_wait", "products": 7 * a.layers, "spin_count": SPIN_COUNT,
                      "cores": os.cpu_count(), **summary(cases)}))


if __name__ == "__main__":
    main()
