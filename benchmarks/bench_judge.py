"""The judge, loaded in privact's process or served: the same leaves judged three ways.

- privact:   privact.judge_leaves with the judge model loaded here (what collect and eval do
             without --judge-url): every judge prompt of the leaves batched, shared prefixes
             prefilled once.
- serve:     the same leaves through --judge-url against `transformers serve MODEL --continuous-batching`
             on 127.0.0.1, --judge-concurrency requests in flight (privact.judge_endpoint).
- serve-seq: the same against `transformers serve` without continuous batching (one request at a time).

The leaves are synthetic actions on the first --cases bundled train cases, --leaves per case, half
of them quoting one of the case's sensitive items, so that both verdicts occur. The judge follows
collect's default protocol, the release's (through the server: each chat rendered here with the
judge's tokenizer and posted to /completions), greedy, --judge-max-new-tokens per call,
float32 on both sides, the same weights (SmolLM2-135M-Instruct saved as a plain folder). Each side
runs once after an untimed warm-up call; the server's start-up is not timed. It prints seconds per
case for each, how many verdict texts equal the local judge's, and a JSON line.

    python benchmarks/bench_judge.py                          # 2 cases x 4 leaves, 64-token verdicts
Needs the serving extras: pip install fastapi uvicorn "openai>=1.98" rich starlette
"""

import collections
import functools
import json
import os
import tempfile
import time

import torch

import common  # noqa: E402  (puts privact.py on the path)
import privact  # noqa: E402


def synthetic_leaves(cases, per_case):
    """(leaf, case, path) with a refiner output holding an action of the case's tool; odd ones quote an item."""
    leaves = []
    for case in cases:
        t = case["trajectory"]
        for i in range(per_case):
            text = f"Hi, here is the update you asked for ({i})." + (
                f" Also: {t['sensitive_info_items'][0]}" if i % 2 else ""
            )
            args = dict.fromkeys(json.loads(privact.input_skeleton(t["final_action"])), text)
            output = f"Thought: I will send it.\nAction: {t['final_action']}\nAction Input: {json.dumps(args)}"
            leaves.append((privact.Node("refiner", [], output), case, [("refiner", output)]))
    return leaves


def judge(leaves, judge_fn, args):
    """Judge copies of `leaves` -> (seconds, verdict texts in order)."""
    copies = [(privact.Node(leaf.role, [], leaf.output), case, path) for leaf, case, path in leaves]
    cfg = privact.CollectConfig(judge_max_new_tokens=args.judge_max_new_tokens, batch_size=args.batch_size)
    start = time.perf_counter()
    privact.judge_leaves(copies, judge_fn, cfg, collections.Counter())
    return time.perf_counter() - start, [leaf.judgment["judge_outputs"] for leaf, _, _ in copies]


def main():
    ap = common.parser(__doc__.split("\n\n")[0], model="smollm2", batch_size=16, judge_max_new_tokens=64)
    ap.add_argument("--cases", type=int, default=2, help="bundled train cases")
    ap.add_argument("--leaves", type=int, default=4, help="judged actions per case")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight against the server")
    args = ap.parse_args()
    common.serving_available()
    torch.manual_seed(0)
    leaves = synthetic_leaves(privact.load_cases("", "train", args.cases), args.leaves)
    with tempfile.TemporaryDirectory() as folder, open(os.path.join(folder, "serve.log"), "w") as log:
        model, tok = privact.load_model(args.model, torch.float32, "cpu", generating=True)
        model.save_pretrained(os.path.join(folder, "judge"))
        tok.save_pretrained(os.path.join(folder, "judge"))
        local = functools.partial(privact.generate_batched, model, tok, batch_size=args.batch_size)
        judge(leaves[:1], local, args)  # warm-up
        results = {"privact": judge(leaves, local, args)}
        for name, cb in (("serve", True), ("serve-seq", False)):
            proc, url = common.serve(os.path.join(folder, "judge"), log, flags=["--continuous-batching"] * cb)
            try:
                cfg = privact.CollectConfig(
                    judge_url=url, judge_model=os.path.join(folder, "judge"), judge_concurrency=args.concurrency
                )
                served = functools.partial(privact.judge_endpoint, cfg, tok)
                judge(leaves[:1], served, args)  # warm-up: the server's first request loads and compiles
                results[name] = judge(leaves, served, args)
            finally:
                proc.kill()
                proc.wait()
    calls = sum(len(outs) for outs in results["privact"][1])
    out = {
        "cases": args.cases,
        "leaves": len(leaves),
        "judge_calls": calls,
        "judge_max_new_tokens": args.judge_max_new_tokens,
        "concurrency": args.concurrency,
        "torch": torch.__version__,
    }
    for name, (seconds, texts) in results.items():
        same = 0  # verdict texts equal to the local judge's
        for mine, local in zip(texts, results["privact"][1], strict=True):
            same += sum(a == b for a, b in zip(mine, local, strict=True))
        out[name] = {
            "seconds_per_case": round(seconds / args.cases, 2),
            "verdict_texts_equal_to_local": f"{same}/{calls}",
        }
        print(
            f"{name:>9}: {seconds / args.cases:.2f} s per case; {same} of {calls} verdict texts equal to the local "
            "judge's"
        )
    out["serve_over_privact"] = round(out["serve"]["seconds_per_case"] / out["privact"]["seconds_per_case"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
