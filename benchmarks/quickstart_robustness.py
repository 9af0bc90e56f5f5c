"""Does the README quick start work whatever numbers a machine draws? Runs its block, as written,
in fresh copies of the project for several seeds and both dtypes, and prints per run the pairs
each trained role got, every command's exit status and the minutes it took.

The block is taken from README.md; each `privact.py collect|eval` command gets `--seed S --dtype D`
and each `privact.py train` gets `--seed S` appended to its first line (the quick start itself
uses the defaults: seed 0, --dtype auto: float32 on a CPU).

    python benchmarks/quickstart_robustness.py --seeds 0,1,2,3,4 --dtypes bfloat16,float32
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def quick_start():
    with open(os.path.join(HERE, "README.md")) as fh:
        text = fh.read()
    return re.search(r"```bash\n(.*?)```", text.split("\n## Quick start", 1)[1], re.S).group(1)


def with_seed(block, seed, dtype):
    block = re.sub(r"privact\.py (collect|eval) ", rf"privact.py \1 --seed {seed} --dtype {dtype} ", block)
    return re.sub(r"privact\.py train ", rf"privact.py train --seed {seed} ", block)


def run_once(block, seed, dtype, keep=""):
    """-> (pairs per role, exit status of each privact.py command, minutes) in a fresh copy
    (whose runs/ folder is copied to `keep` if that does not exist yet)."""
    lines = [line for line in with_seed(block, seed, dtype).replace("\\\n", " ").splitlines() if line.strip()]
    script = "\n".join(line + ('; echo "EXIT $?"' if "privact.py" in line else "") for line in lines)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(SNAPSHOT, tmp, dirs_exist_ok=True)
        env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
        start = time.time()
        out = subprocess.run(["bash", "-c", script], cwd=tmp, env=env, capture_output=True, text=True).stdout
        codes = [int(x) for x in re.findall(r"^EXIT (\d+)$", out, re.M)]
        if keep and not os.path.exists(keep):
            shutil.copytree(os.path.join(tmp, "runs"), keep)
        summary = glob.glob(os.path.join(tmp, "runs", "*", "summary.json"))
        stats = {}
        if summary:
            with open(summary[0]) as fh:
                stats = json.load(fh)
        pairs = {k.split("_", 1)[1]: v for k, v in stats.items() if k.startswith("collect/pairs_")}
        return pairs, codes, (time.time() - start) / 60


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes for collect and eval")
    ap.add_argument("--keep", default="", help="copy the first run's runs/ folder here")
    args = ap.parse_args()
    block = quick_start()
    global SNAPSHOT  # the project as it is now: edits made while this runs do not leak into later runs
    SNAPSHOT = tempfile.mkdtemp()
    for name in ("privact.py", "judge_prompts.py", "ds_zero2_offload.json"):
        shutil.copy(os.path.join(HERE, name), SNAPSHOT)
    shutil.copytree(os.path.join(HERE, "data"), os.path.join(SNAPSHOT, "data"))
    print(
        f"{'seed':>4} {'dtype':>9} {'verifier pairs':>15} {'refiner pairs':>14}  exit codes        minutes", flush=True
    )
    for seed in map(int, args.seeds.split(",")):
        for dtype in args.dtypes.split(","):
            pairs, codes, minutes = run_once(block, seed, dtype, args.keep)
            print(
                f"{seed:>4} {dtype:>9} {pairs.get('verifier', 0):>15} {pairs.get('refiner', 0):>14}  "
                f"{','.join(map(str, codes)):<16} {minutes:6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
