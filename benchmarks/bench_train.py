"""DPO training cost: privact's hand-written DPO vs TRL's DPOTrainer on the same pairs.

Each trainer runs in its own subprocess (so peak resident memory is its own) on the same pairs
(real PrivacyLens refiner prompts, synthetic chosen/rejected actions), the same model, batch,
accumulation, steps, beta and learning rate, in float32 on the CPU (or both under bf16 autocast,
--mixed-precision bf16). The default, 4 steps of 2 x 2 pairs, is 2 epochs over the 8 pairs, so both
sides pay for their reference in a second, reshuffled epoch: privact scores every micro-batch of every
epoch with the policy itself before the first step (one forward per pair per epoch); TRL, by default,
holds a frozen copy of the model and scores each micro-batch with it beside the policy, as the
release's TRL run did. Printed: wall time of the whole training command (model load, optimisation),
pairs/s over that wall time, and peak RSS, plus the ratios.

    python benchmarks/bench_train.py

TRL is a benchmark-only dependency (`pip install trl`); privact.py never imports it. Without it
only privact is measured. TRL runs with its defaults for the reference model (a frozen copy held
in memory); pass --trl-precompute to have it precompute reference log-probs instead.

Peak RSS counts what glibc keeps of freed memory for reuse. Each side runs as its users run it:
privact's train hands freed blocks of 4 MB and more back to the OS (privact.return_freed_blocks),
TRL runs under glibc's defaults. To run both under the same threshold (both children inherit it, and
privact then leaves it as set):

    MALLOC_MMAP_THRESHOLD_=4194304 python benchmarks/bench_train.py
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401  (puts privact.py on the path)
import privact
from bench_rollout import cpu_name

HERE = os.path.dirname(os.path.abspath(__file__))


def make_pairs(data, n, path):
    """Refiner prompts of n train cases; chosen keeps the sensitive items out, rejected leaks them."""
    rows = []
    for case in privact.load_cases(data, "train", n):
        t = case["trajectory"]
        tool, arg = t["final_action"], privact.P.FINAL_TOOLS[t["final_action"]].split(":")[0].rstrip("*")
        draft = f'Thought: I will do what {t["user_name"]} asked.\nAction: {tool}\nAction Input: {{"{arg}": "..."}}'
        chat = privact.build_chat("refiner", case, [("generator", draft), ("verifier", "Check what is shared.")])
        body = " ".join(t["sensitive_info_items"])
        rows.append(
            {
                "case": case["name"],
                "role": "refiner",
                "prompt": chat,
                "chosen": f"Thought: Share only what the task needs.\nAction: {tool}\nAction Input: "
                + json.dumps({arg: "A short update on the task, with no personal details."}),
                "rejected": f"Thought: Share everything.\nAction: {tool}\nAction Input: {json.dumps({arg: body})}",
            }
        )
    with open(path, "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))


def run_privact(args, pairs, out):
    privact.main(
        [
            "train",
            "--pairs",
            pairs,
            "--model",
            args.model,
            "--out",
            out,
            "--batch-size",
            str(args.batch_size),
            "--grad-accum",
            str(args.grad_accum),
            "--max-steps",
            str(args.steps),
            "--epochs",
            "1000",
            "--beta",
            "0.4",
            "--lr",
            str(args.lr),
            "--seed",
            "0",
            "--save-every",
            "0",
            "--mixed-precision",
            args.mixed_precision,
            "--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing",
        ]
    )
    with open(os.path.join(out, "train_metrics.json")) as fh:
        return json.load(fh)["step"]


def run_trl(args, pairs, out):
    import datasets
    import torch
    from trl import DPOConfig, DPOTrainer

    model, tok = privact.load_model(args.model, dtype=torch.float32)
    with open(pairs) as fh:
        rows = [json.loads(line) for line in fh]
    ds = datasets.Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    )
    cfg = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=0.4,
        max_length=4096,
        lr_scheduler_type="cosine",
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        use_cpu=True,
        bf16=args.mixed_precision == "bf16",
        seed=0,
        dataloader_num_workers=0,
        precompute_ref_log_probs=args.trl_precompute,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    trainer.train()
    return trainer.state.global_step


def child(args):
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        steps = (run_privact if args.child == "privact" else run_trl)(args, args.pairs, os.path.join(tmp, "out"))
    seconds = time.perf_counter() - start
    pairs = steps * args.batch_size * args.grad_accum
    print(
        "RESULT "
        + json.dumps(
            {
                "trainer": args.child,
                "steps": steps,
                "pairs": pairs,
                "seconds": round(seconds, 1),
                "pairs_per_s": round(pairs / seconds, 3),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }
        )
    )


def main():
    ap = common.parser(__doc__, data="", model="smollm2")
    ap.add_argument("--pairs", default="", help="a pairs JSONL to train on (default: built from --num-pairs cases)")
    ap.add_argument(
        "--num-pairs", type=int, default=8, help="pairs to build from train cases when --pairs is not given"
    )
    ap.add_argument("--batch-size", type=int, default=2, help="pairs per micro-batch, both trainers")
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step, both trainers")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps, both trainers (4: 2 epochs of 8 pairs)")
    ap.add_argument("--lr", type=float, default=5e-7, help="learning rate, both trainers")
    ap.add_argument(
        "--gradient-checkpointing",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="gradient checkpointing on both sides (the default of both: privact's flag, TRL's DPOConfig)",
    )
    ap.add_argument(
        "--trl-precompute", action="store_true", help="TRL precomputes reference log-probs (no ref model held)"
    )
    ap.add_argument(
        "--mixed-precision",
        default="no",
        choices=["no", "bf16"],
        help="no: float32 on both sides; bf16: autocast on both (privact --mixed-precision bf16, TRL bf16=True)",
    )
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    tmp = tempfile.mkdtemp()
    if args.model in privact.EMBEDDED_MODELS:  # TRL re-reads the config from the path: give both a plain HF folder
        model, tok = privact.load_model(args.model)
        model.save_pretrained(os.path.join(tmp, "model"))
        tok.save_pretrained(os.path.join(tmp, "model"))
        args.model = os.path.join(tmp, "model")
    if not args.pairs:
        args.pairs = os.path.join(tmp, "pairs_refiner.jsonl")
        make_pairs(args.data, args.num_pairs, args.pairs)
    try:
        import trl  # noqa: F401

        trainers = ["privact", "trl"]
    except ImportError:
        print("TRL is not installed (pip install trl): measuring privact alone")
        trainers = ["privact"]
    results = {}
    for name in trainers:
        cmd = (
            [sys.executable, __file__, "--child", name] + sys.argv[1:] + ["--pairs", args.pairs, "--model", args.model]
        )
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or not line:
            sys.exit(f"{name} run failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(line[len("RESULT ") :])
        r = results[name]
        print(
            f"{name:>8}: {r['pairs']} pairs in {r['seconds']} s = {r['pairs_per_s']} pairs/s, "
            f"peak RSS {r['peak_rss_mb']} MB",
            flush=True,
        )
    summary = {"bench": "train", "args": vars(args), "cpu": cpu_name(), **results}
    summary["versions"] = privact.provenance()["versions"]
    if "trl" in results:
        summary["speedup_pairs_per_s"] = round(results["privact"]["pairs_per_s"] / results["trl"]["pairs_per_s"], 2)
        summary["memory_ratio"] = round(results["privact"]["peak_rss_mb"] / results["trl"]["peak_rss_mb"], 2)
        print(f"privact vs TRL: {summary['speedup_pairs_per_s']}x pairs/s, {summary['memory_ratio']}x peak memory")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
