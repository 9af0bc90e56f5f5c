"""The judge, loaded in privact's process or served: the same leaves judged three ways.

- privact:   privact.judge_leaves with the judge model loaded here (what collect and eval do
             without --judge-url): every judge prompt of the leaves batched, shared prefixes
             prefilled once.
- serve:     the same leaves through --judge-url against `transformers serve MODEL --continuous-batching`
             on 127.0.0.1, --judge-concurrency requests in flight (privact.judge_served).
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

import copy
import functools
import json
import math
import os
import sys
import tempfile
import time

import torch

import common
import privact
from bench_rollout import cpu_name


def synthetic_trees(cases, per_case):
    """Per case a root whose `per_case` children are refiner outputs holding an action of the case's tool; odd
    ones quote a sensitive item."""
    roots = []
    for case in cases:
        t = case["trajectory"]
        root = privact.Node("input", [])
        for i in range(per_case):
            text = f"Hi, here is the update you asked for ({i})."
            if i % 2:
                text += f" Also: {t['sensitive_info_items'][0]}"
            args = dict.fromkeys(json.loads(privact.input_skeleton(t["final_action"])), text)
            output = f"Thought: I will send it.\nAction: {t['final_action']}\nAction Input: {json.dumps(args)}"
            root.children.append(privact.Node("refiner", [], output))
        roots.append(root)
    return roots


def judged(roots, cases, judge):
    """Judge copies of the trees -> (seconds, per leaf its verdict texts)."""
    copies = copy.deepcopy(roots)
    start = time.perf_counter()
    privact.judge_leaves(copies, cases, judge)
    seconds = time.perf_counter() - start
    return seconds, [leaf.judgment["judge_outputs"] for root in copies for leaf in root.children]


def pages_in_flight(tok, roots, cases, concurrency, new_tokens, page=256):
    """Pages of `page` tokens (transformers' default) that `concurrency` of the leaves' judge requests fill at once.
    Untold, continuous batching sizes its paged cache to 90% of free memory, and on a CPU zeroes those gigabytes
    before it answers (about 30 s on a 2-core machine with 24 GiB)."""
    lengths = []
    for root, case in zip(roots, cases, strict=True):
        for leaf in root.children:
            for chat in privact.judge_chats(case, leaf.output):
                lengths.append(len(tok(privact.chat_text(tok, chat, generation_prompt=False))["input_ids"]))
    per_request = math.ceil((max(lengths) + new_tokens + 1) / page)
    return per_request * min(concurrency, len(lengths))


def main():
    ap = common.parser(__doc__.split("\n\n")[0], model="smollm2", batch_size=16, judge_max_new_tokens=64)
    ap.add_argument("--cases", type=int, default=2, help="bundled train cases")
    ap.add_argument("--leaves", type=int, default=4, help="judged actions per case")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight against the server")
    ap.add_argument(
        "--arms",
        default="serve,serve-seq",
        help="the served arms: serve (continuous batching), serve-seq (one request at a time); the judge in process "
        "always runs, as their reference",
    )
    args = ap.parse_args()
    common.serving_available()
    arms = args.arms.split(",")
    if not set(arms) <= {"serve", "serve-seq"}:
        sys.exit(f"--arms {args.arms}: serve, serve-seq or both")
    torch.manual_seed(0)
    cases = privact.load_cases("", "train", args.cases)
    roots = synthetic_trees(cases, args.leaves)
    with tempfile.TemporaryDirectory() as folder, open(os.path.join(folder, "serve.log"), "w") as log:
        model, tok = privact.load_model(args.model, torch.float32, "cpu")
        saved = os.path.join(folder, "judge")
        model.save_pretrained(saved)
        tok.save_pretrained(saved)
        models = {"judge": (model, tok)}
        cfg = privact.CollectConfig(judge_max_new_tokens=args.judge_max_new_tokens, batch_size=args.batch_size)
        local = functools.partial(privact.judge, models, cfg)
        judged(roots[:1], cases[:1], local)  # warm-up
        results = {"privact": judged(roots, cases, local)}
        pages = pages_in_flight(tok, roots, cases, args.concurrency, args.judge_max_new_tokens)
        batching = ["--continuous-batching", "--cb-num-blocks", str(pages)]
        for name in arms:
            flags = batching if name == "serve" else []
            proc, url = common.serve(saved, log, flags=flags)
            try:
                served_cfg = privact.CollectConfig(
                    judge_url=url,
                    judge_model=saved,
                    judge_concurrency=args.concurrency,
                    judge_max_new_tokens=args.judge_max_new_tokens,
                )
                served = functools.partial(privact.judge, models, served_cfg)
                judged(roots[:1], cases[:1], served)  # warm-up: the server's first request loads and compiles
                results[name] = judged(roots, cases, served)
            finally:
                proc.kill()
                proc.wait()
    calls = sum(len(texts) for texts in results["privact"][1])
    out = {"cases": args.cases, "leaves": args.cases * args.leaves, "judge_calls": calls, "args": vars(args)}
    out.update(cpu=cpu_name(), versions=privact.provenance()["versions"])
    for name, (seconds, texts) in results.items():
        same = 0  # verdict texts equal to the local judge's
        for mine, local_texts in zip(texts, results["privact"][1], strict=True):
            same += sum(a == b for a, b in zip(mine, local_texts, strict=True))
        out[name] = {"seconds_per_case": round(seconds / args.cases, 2), "verdicts_equal_to_local": f"{same}/{calls}"}
        print(
            f"{name:>9}: {seconds / args.cases:.2f} s per case; {same} of {calls} verdict texts equal the local judge's"
        )
    for name in arms:
        out[f"{name}_over_privact"] = round(out[name]["seconds_per_case"] / out["privact"]["seconds_per_case"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
