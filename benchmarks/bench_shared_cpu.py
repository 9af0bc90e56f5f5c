"""A CPU that other work shares: how long one small collect takes under each thread setting, on a quiet CPU
and beside busy processes, side by side in one run.

The same collect (SmolLM2-135M, --num-cases 2 --chunk-cases 1 --branching 1,2,2 --max-new-tokens 32, forced
verdicts) runs four ways, each in fresh processes:

- spinning:       one process, torch's default threads (one per core), OpenMP's default wait policy: a thread
                  that waits for the others spins on its core for a while first (privact's default: it sets no
                  wait policy);
- passive:        the same with OMP_WAIT_POLICY=PASSIVE in the environment: a waiting thread sleeps at once;
- one-thread:     one process, OMP_NUM_THREADS=1;
- two-processes:  ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2, OMP_NUM_THREADS=1 in each: the chunks shared
                  between two 1-thread processes.

Then again beside --burners busy processes (`while True: pass`, one per core by default). Every arm must write
the same records as the first: the settings change the time, never the results. Printed: a table of seconds per
arm and condition, then one JSON line.

    python benchmarks/bench_shared_cpu.py                # about 25 minutes on 2 cores
    python benchmarks/bench_shared_cpu.py --tiny         # a tiny random model, seconds (the tests run it)
    python benchmarks/bench_shared_cpu.py --arms spinning,passive --repeats 5 --burners 0
                                                         # the quiet cost of PASSIVE: 5 runs of each, interleaved

With --repeats N every quiet arm runs N times, round by round (each round every arm once, in turn), and the table
shows the mean; --burners 0 skips the loaded runs.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import common
import conftest  # noqa: F401  (puts privact.py on the path)
import privact
from bench_rollout import cpu_name

HERE = os.path.dirname(os.path.abspath(__file__))
PRIVACT = os.path.join(HERE, "..", "privact.py")

# arm -> (environment variables set, processes)
ARMS = {
    "spinning": ({}, 1),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 1),
    "one-thread": ({"OMP_NUM_THREADS": "1"}, 1),
    "two-processes": ({"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}, 2),
}


def collect_command(args, arm, out, port):
    """The collect every arm runs, under torchrun when it runs on several processes."""
    flags = ["collect", "--model", args.model, "--out", out, "--num-cases", "2", "--chunk-cases", "1"]
    flags += ["--branching", "1,2,2", "--max-new-tokens", str(args.max_new_tokens), "--judge-verdict", "forced"]
    flags += ["--judge-max-new-tokens", str(args.max_new_tokens), "--dtype", "float32"]
    processes = ARMS[arm][1]
    if processes == 1:
        return [sys.executable, PRIVACT, *flags]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return [*launcher, "--master_port", str(port), PRIVACT, *flags]


def run_arm(args, arm, out, port, limit=None):
    """Seconds of one arm's collect, and its records (the trees, without the clocks); (None, None) when it ran past
    `limit` seconds and was stopped."""
    variables = ARMS[arm][0]
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(variables)
    start = time.perf_counter()
    # its own process group, so that a stopped arm's workers (torchrun's) stop with it
    proc = subprocess.Popen(
        collect_command(args, arm, out, port),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, None
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{arm} failed:\n{stderr[-3000:]}")
    records = json.dumps([dataclasses.asdict(r["tree"]) for r in privact.read_records(out)])
    return seconds, records


def burners(count):
    """`count` processes that keep a core busy each, until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def measure(args, arms, tmp):
    """{condition: {arm: [seconds of each run, None where stopped]}}: the quiet runs, --repeats rounds of every arm
    in turn, then one loaded run of each beside --burners busy processes."""
    runs = {"quiet": {arm: [] for arm in arms}, "loaded": {arm: [] for arm in arms}}
    rounds = {"quiet": args.repeats, "loaded": 1 if args.burners else 0}
    first = None
    for condition, count in rounds.items():
        busy = burners(args.burners) if condition == "loaded" else []
        try:
            for n, arm in [(n, arm) for _ in range(count) for n, arm in enumerate(arms)]:
                out = os.path.join(tmp, f"{condition}-{arm}")
                shutil.rmtree(out, ignore_errors=True)
                limit = None
                if condition == "loaded":
                    quiet = runs["quiet"][arm]
                    limit = args.limit * sum(quiet) / len(quiet)
                arm_seconds, records = run_arm(args, arm, out, 29600 + n, limit)
                if arm_seconds is None:
                    runs[condition][arm].append(None)
                    print(f"{condition:>6} {arm:>13}: stopped after {limit:.1f} s", flush=True)
                    continue
                first = first or records
                if records != first:
                    sys.exit(f"{condition} {arm}: other records than the first arm's")
                runs[condition][arm].append(round(arm_seconds, 1))
                print(f"{condition:>6} {arm:>13}: {arm_seconds:7.1f} s", flush=True)
        finally:
            for proc in busy:
                proc.kill()
    return runs


def mean_seconds(runs):
    """{condition: {arm: the mean of its runs, None where one was stopped}}, for the arms that ran."""
    seconds = {}
    for condition, arm_runs in runs.items():
        seconds[condition] = {}
        for arm, values in arm_runs.items():
            if values and None not in values:
                seconds[condition][arm] = round(sum(values) / len(values), 1)
            elif values:
                seconds[condition][arm] = None
    return seconds


def main():
    ap = common.parser(__doc__, model="smollm2", max_new_tokens=32)
    ap.add_argument("--burners", type=int, default=os.cpu_count(), help="busy processes beside the loaded runs")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model and 4-token outputs: seconds")
    ap.add_argument("--limit", type=float, default=6.0, help="a loaded arm stops after this many times its quiet time")
    ap.add_argument("--repeats", type=int, default=1, help="quiet runs of every arm, interleaved round by round")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"the arms to run, comma separated, of {','.join(ARMS)}")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if not set(arms) <= set(ARMS):
        ap.error(f"--arms {args.arms}: choose from {','.join(ARMS)}")
    tmp = tempfile.mkdtemp()
    if args.tiny:
        args.model = conftest.tiny_llama(os.path.join(tmp, "tiny"))
        args.max_new_tokens = 4
    privact.load_model(args.model)  # the embedded model's one-time conversion, outside every clock
    runs = measure(args, arms, tmp)
    seconds = mean_seconds(runs)
    shutil.rmtree(tmp)
    print(f"\n{'arm':>13} {'quiet s':>9} {'loaded s':>9} {'loaded / quiet':>15}")
    for arm in arms:
        quiet = seconds["quiet"][arm]
        if arm not in seconds["loaded"]:
            print(f"{arm:>13} {quiet:9.1f}")
        elif seconds["loaded"][arm] is None:
            print(f"{arm:>13} {quiet:9.1f} {'stopped':>9} {'>' + str(args.limit):>14}x")
        else:
            loaded = seconds["loaded"][arm]
            print(f"{arm:>13} {quiet:9.1f} {loaded:9.1f} {loaded / quiet:14.1f}x")
    summary = {"bench": "shared_cpu", "args": vars(args), "cpu": cpu_name(), "seconds": seconds, "runs": runs}
    print(json.dumps({**summary, "versions": privact.provenance()["versions"]}))


if __name__ == "__main__":
    main()
