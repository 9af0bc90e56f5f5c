"""Rollout throughput: privact's batched generation vs one `generate` call per prompt.

Both paths sample the same generator prompts (real PrivacyLens cases, B samples per prompt, the
same seed, dtype and max_new_tokens) on the same model in one process, and print generated
tokens per second and their ratio.

    python benchmarks/bench_rollout.py

- batched:    privact.generate_batched: all prompts in length-sorted, left-padded batches of
              --batch-size sequences, each prompt prefilled once and its KV cache shared by its
              B samples.
- per-prompt: for each prompt, model.generate(prompt, num_return_sequences=B), the loop one
              writes first.
"""

import json
import os
import time

import torch

import common  # noqa: E402  (puts privact.py on the path)
import privact  # noqa: E402


def per_prompt(model, tok, chats, num_return, max_new_tokens, temperature):
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        num_return_sequences=num_return,
        pad_token_id=tok.pad_token_id,
        eos_token_id=privact.stop_token_ids(model, tok),
    )
    n_tokens = 0
    for chat in chats:
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + privact.P.ACTION_PREFIX
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        n_tokens += int((out[:, ids.shape[1] :] != tok.pad_token_id).sum())
    return n_tokens


def main():
    shared = {"data": "", "model": "smollm2", "max_new_tokens": 64, "batch_size": 16, "temperature": 1.0}
    ap = common.parser(__doc__, **shared, dtype="bfloat16", seed=0)
    ap.add_argument("--num-prompts", type=int, default=8, help="generator prompts (train cases)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt, B (collect's default branching)")
    args = ap.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    cases = privact.load_cases(args.data, "train", args.num_prompts)
    model, tok = privact.load_model(args.model, dtype=getattr(torch, args.dtype))
    chats = [privact.build_chat("generator", c, []) for c in cases]
    lengths = [
        len(x)
        for x in tok(
            [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats],
            add_special_tokens=False,
        )["input_ids"]
    ]
    results = {}
    for name in ("batched", "per-prompt"):
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        if name == "batched":
            decoding = privact.Decoding(
                args.samples, args.max_new_tokens, args.temperature, prefix=privact.P.ACTION_PREFIX, desc="batched"
            )
            _, n = privact.generate_batched(model, tok, chats, decoding, args.batch_size)
        else:
            n = per_prompt(model, tok, chats, args.samples, args.max_new_tokens, args.temperature)
        seconds = time.perf_counter() - start
        results[name] = {"seconds": round(seconds, 2), "generated_tokens": n, "tokens_per_s": round(n / seconds, 1)}
        print(f"{name:>10}: {n} tokens in {seconds:.1f} s = {n / seconds:.1f} tokens/s", flush=True)
    ratio = results["batched"]["tokens_per_s"] / results["per-prompt"]["tokens_per_s"]
    wall_ratio = results["per-prompt"]["seconds"] / results["batched"]["seconds"]
    print(f"batched / per-prompt: {ratio:.2f}x tokens/s, {wall_ratio:.2f}x less wall time")
    print(
        json.dumps(
            {
                "bench": "rollout",
                "args": vars(args),
                "prompt_tokens": {"min": min(lengths), "max": max(lengths), "mean": round(sum(lengths) / len(lengths))},
                "threads": torch.get_num_threads(),
                **results,
                "ratio_tokens_per_s": round(ratio, 2),
                "ratio_wall": round(wall_ratio, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
