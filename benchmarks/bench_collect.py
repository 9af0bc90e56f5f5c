"""Whole-collect cost: privact's collect path vs the straightforward Hugging Face loop.

Both collect the same cases in one process with the same models, seed, dtype and limits:

- privact:  privact.rollout_chunk, the function `collect` runs on each chunk of cases: every
            level's prompts across the chunk in batched, shared-prefix generate calls, then all
            judge prompts batched the same way.
- HF loop:  what one writes first. One model.generate(num_return_sequences=B) per tree node and
            one model.generate per judge prompt (strict protocol: plus a second call of 4 tokens after
            an appended "\nAnswer:" when a verdict has none; privacylens: stopping at "\n\n---").
            It replays privact's tree: each node's children are
            sampled from the very prompt privact's children saw, and it judges the same leaves,
            so both sides process the same prompts and only the calling pattern differs.

Each side runs --repeats times (default 2) after one short untimed generate that wakes the
process up, and its fastest run counts, as timeit does: on a shared 2-core machine a neighbour's
burst can slow one run by a quarter. It prints seconds per case for both; the last line is a JSON
object with `speedup` (HF loop seconds / privact seconds), every run's seconds, and the prompt
tokens privact prefilled vs a plain prefill.

    python benchmarks/bench_collect.py                      # 2 train cases, 2,2,2, 64 new tokens
"""

import json
import time

import torch

import common  # noqa: E402  (puts privact.py on the path)
import privact  # noqa: E402


def hf_generate(model, tok, chat, decoding):
    """One plain generate(num_return_sequences=B) of `chat` -> B texts (the prefix, then the completion)."""
    from transformers import GenerationConfig

    sample = decoding.samples > 1
    gen = GenerationConfig(
        max_new_tokens=decoding.max_new_tokens,
        do_sample=sample,
        num_return_sequences=decoding.samples,
        stop_strings=decoding.stop,
        pad_token_id=tok.pad_token_id,
        eos_token_id=privact.stop_token_ids(model, tok),
        **({"temperature": decoding.temperature, "top_p": 1.0, "top_k": 0} if sample else {}),
    )
    text = tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=decoding.generation_prompt, date_string=decoding.chat_date
    )
    ids = tok(text + decoding.prefix, add_special_tokens=decoding.special_tokens, return_tensors="pt").input_ids
    ids = ids.to(model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen, tokenizer=tok)
    return [decoding.prefix + t for t in tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)]


def hf_loop(records, cases, chain, model, tok, args):
    """One generate per node of privact's trees (same prompts), one per judge prompt of its leaves."""
    strict = args.judge_protocol == "strict"
    release = args.judge_protocol == "release"  # rendered as the release renders it: no generation prompt, a BOS added
    judging = privact.Decoding(
        max_new_tokens=args.judge_max_new_tokens,
        stop=None if strict else "\n\n---",
        generation_prompt=not release,
        special_tokens=release,
    )
    for rec, case in zip(records, cases, strict=True):
        frontier = [privact.node_from_dict(rec["tree"])]
        for role, width in zip(chain.roles, chain.branching, strict=True):
            sampling = privact.Decoding(
                width, args.max_new_tokens, args.temperature, prefix=privact.action_prefix(role)
            )
            for node in frontier:
                hf_generate(model, tok, node.children[0].prompt, sampling)
            frontier = [c for node in frontier for c in node.children]
        for _, path in privact.leaves_with_paths(privact.node_from_dict(rec["tree"])):
            for chat in privact.judge_chats(case, privact.latest(path, privact.DRAFT_ROLES), args.judge_protocol):
                text = hf_generate(model, tok, chat, judging)[0]
                if strict and "answer:" not in text.lower():
                    hf_generate(model, tok, chat, privact.Decoding(max_new_tokens=4, prefix=text + "\nAnswer:"))


def timed(run, args, n_cases):
    """Seconds per case of each of --repeats runs (each from the same seed), and the last result."""
    seconds = []
    for _ in range(args.repeats):
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        result = run()
        seconds.append((time.perf_counter() - start) / n_cases)
    return seconds, result


def main():
    shared = {"data": "", "model": "smollm2", "batch_size": 16, "max_new_tokens": 64, "judge_max_new_tokens": 64}
    ap = common.parser(__doc__, **shared, temperature=1.0, dtype="bfloat16", seed=0)
    ap.add_argument("--num-cases", type=int, default=2, help="train cases to collect")
    ap.add_argument("--branching", default="2,2,2", help="samples per node at each level")
    ap.add_argument(
        "--judge-protocol",
        default="release",
        choices=("release", "privacylens", "strict"),
        help="collect's default: release",
    )
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per side; the fastest counts")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")

    roles = privact.parse_topology("generator,verifier,refiner")
    chain = privact.Chain(roles, privact.parse_branching(args.branching, roles))
    cases = privact.load_cases(args.data, "train", args.num_cases)
    model, tok = privact.load_model(args.model, dtype=getattr(torch, args.dtype))
    models = {**dict.fromkeys(roles, (model, tok)), "judge": (model, tok)}
    cfg = privact.CollectConfig(
        max_new_tokens=args.max_new_tokens,
        judge_max_new_tokens=args.judge_max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        judge_protocol=args.judge_protocol,
    )
    hf_generate(
        model, tok, privact.build_chat("generator", cases[0], []), privact.Decoding(max_new_tokens=4)
    )  # warm-up

    def privact_side():
        return privact.rollout_chunk(cases, chain, models, cfg)

    ours, records = timed(privact_side, args, len(cases))
    print(f" privact: {min(ours):.1f} s per case", flush=True)
    theirs, _ = timed(lambda: hf_loop(records, cases, chain, model, tok, args), args, len(cases))
    print(f" HF loop: {min(theirs):.1f} s per case", flush=True)
    leaves = [
        leaf.judgment for r in records for leaf, _ in privact.leaves_with_paths(privact.node_from_dict(r["tree"]))
    ]

    def total(key):
        return round(sum(r.get(key, 0) for r in records))

    print(
        json.dumps(
            {
                "bench": "collect",
                "args": vars(args),
                "threads": torch.get_num_threads(),
                "privact_seconds_per_case": round(min(ours), 2),
                "hf_loop_seconds_per_case": round(min(theirs), 2),
                "speedup": round(min(theirs) / min(ours), 3),
                "privact_runs": [round(t, 4) for t in ours],
                "hf_loop_runs": [round(t, 4) for t in theirs],
                "leaves": len(leaves),
                "judged_leaves": sum(j["judged"] for j in leaves),
                "leaves_calling_the_tool": sum(j["calls_tool"] for j in leaves),
                "generated_tokens": total("generated_tokens"),
                "judge_tokens": total("judge_tokens"),
                "prompt_tokens_prefilled": total("policy_prefill_tokens") + total("judge_prefill_tokens"),
                "prompt_tokens_plain": total("policy_prefill_tokens_plain") + total("judge_prefill_tokens_plain"),
            }
        )
    )


if __name__ == "__main__":
    main()
