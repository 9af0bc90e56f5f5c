"""The benchmarks test themselves: each script's smallest run, and what its figures must satisfy. The fixtures are
conftest.py's (the repository's root); bench_learning.py's round is test_privact.py's system test.

    python3 -m pytest -q benchmarks            # with the default tier
    python3 -m pytest -q -m slow benchmarks    # with the slow tier: a real server, the GPU script in --tiny mode
"""

import json
import os
import subprocess
import sys
import time
import types

import pytest
from conftest import HERE, make_case, needs_serving, needs_smollm2, read_json, write_pairs

import privact

sys.path.insert(0, str(HERE / "benchmarks"))


def run_bench(script, *args, cwd=None, timeout=900):
    """benchmarks/<script> with `args` -> (the JSON object its last line prints, everything it printed)."""
    command = [sys.executable, str(HERE / "benchmarks" / script), *map(str, args)]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def test_bench_rollout_times_every_arm_on_one_chunk(tiny_model):
    """bench_rollout.py --tiny: every arm rolls out and judges the same chunk shape, its decode clocked step by step;
    the speedups are the ratios of the arms' seconds per 1k generated tokens."""
    result, _ = run_bench("bench_rollout.py", "--tiny", tiny_model)
    arms = result["arms"]
    assert list(arms) == ["generate-batched", "generate-per-prompt", "privact-per-prompt", "privact"]
    for figures in arms.values():
        # 1 case, branching 1,2,2: 7 agent outputs of at most 8 tokens; every leaf judged
        assert 0 < figures["policy_tokens"] <= 7 * 8 and figures["judge_tokens"] > 0 and figures["decode_steps"] > 0
        assert figures["kv_mb_a_step"] > 0 and figures["prefill_seconds"] > 0
    per_1k = {arm: figures["seconds_per_1k_tokens"] for arm, figures in arms.items()}
    want = per_1k["privact-per-prompt"] / per_1k["privact"]
    assert result["speedups"]["privact over privact-per-prompt"] == pytest.approx(want, abs=0.01)


def test_the_peer_arm_keeps_privacts_contract(tiny_model):
    """bench_rollout's plain generate returns what privact.generate returns: greedy, the same texts and ids."""
    import bench_rollout

    model, tok = privact.load_model(tiny_model)
    chats = [[{"role": "user", "content": "Hello " * n}] for n in (1, 5, 3)]
    greedy = privact.Decoding(1, 6, None, prefix="Thought:")
    cfg = privact.CollectConfig(batch_size=4)
    assert bench_rollout.plain_generate(model, tok, chats, greedy, cfg) == privact.generate(
        model, tok, chats, greedy, cfg
    )


@pytest.mark.slow
def test_bench_train_trains_grouped_and_one_pair_a_row_on_the_same_pairs(tiny_model):
    """bench_train.py on the tiny model: a sibling group of eight responses (16 pairs), one epoch at batch 4, a
    micro-batch a step: 4 steps either way; grouped rows hold fewer tokens than one row per pair, and the ratios are
    those of the pairs/s and peak memory."""
    args = ["--groups", "1", "--siblings", "8", "--epochs", "1", "--grad-accum", "1"]
    result, _ = run_bench("bench_train.py", "--model", tiny_model, *args, "--trainers", "privact,privact-per-pair")
    grouped, per_pair = result["privact"], result["privact-per-pair"]
    assert result["pairs"] == 16 and grouped["pairs"] == per_pair["pairs"] == 16
    assert grouped["steps_an_epoch"] == per_pair["steps_an_epoch"] == 4
    assert grouped["row_tokens_per_epoch"] < per_pair["row_tokens_per_epoch"]
    ratio = result["ratios"]["privact vs privact-per-pair"]
    assert ratio["speed"] == pytest.approx(grouped["pairs_per_s"] / per_pair["pairs_per_s"], rel=0.02)


def test_bench_gpu_trains_tables_its_hours_and_an_interrupt_keeps_the_figures(tmp_path, monkeypatch):
    """bench_gpu.py --tiny --stages train: privact.py train on synthetic pairs of --max-length, its pairs/s and the
    hours they imply. gpu_run.sh's hard limit sends SIGINT: the stage in flight ends, the later ones are named as not
    run, the earlier figures stay; --time-box skips the stages that would start after it."""
    needs_smollm2()
    result, _ = run_bench("bench_gpu.py", "--tiny", "--stages", "train", "--json", tmp_path / "b.json", cwd=tmp_path)
    assert result == read_json(tmp_path / "b.json")
    hours = {row["job"]: row["hours"] for row in result["hours"]}
    want = 5000 * 12 / result["train"]["pairs_per_s"] / 3600
    assert hours["train verifier, 5000 pairs x 12 epochs"] == pytest.approx(want, rel=0.01, abs=0.01)
    import bench_gpu

    ran = []

    def interrupted(ctx):
        ran.append("eval")
        raise KeyboardInterrupt

    monkeypatch.setitem(
        bench_gpu.STAGE_RUNS, "collect", lambda ctx: ran.append("collect") or ctx.figures.update(collect=1)
    )
    monkeypatch.setitem(bench_gpu.STAGE_RUNS, "eval", interrupted)
    monkeypatch.setitem(bench_gpu.STAGE_RUNS, "train", lambda ctx: ran.append("train"))
    args = types.SimpleNamespace(stages=["train", "eval", "collect"], time_box=0)
    ctx = bench_gpu.Context(args, None, None, {}, "")
    assert bench_gpu.run_stages(ctx, time.perf_counter()) == (["train"], "eval")  # in STAGES order
    assert ran == ["collect", "eval"] and ctx.figures == {"collect": 1}
    args.time_box, ran[:] = 60, []
    assert bench_gpu.run_stages(ctx, time.perf_counter() - 61) == (["collect", "eval", "train"], None) and ran == []


def test_the_rule_judge_reads_the_release_prompts_and_answers_in_its_format():
    """bench_learning.py's rule judge on the chats privact renders: an action carrying a distinctive word of its item
    that the instruction lacks leaks, one carrying only the instruction's does not; helpfulness counts the
    instruction's words; the release's parsers read the answers."""
    import bench_learning

    case = make_case("c")
    judge = bench_learning.RuleJudge([case])
    for output, leaks, helpfulness in (
        ('Action: MessengerSendMessage\nAction Input: {"message": "Bob, Alice has diabetes."}', True, 0),
        ('Action: MessengerSendMessage\nAction Input: {"message": "A short update about the project."}', False, 3),
    ):
        *leak_chats, help_chat = privact.judge_chats(case, output)
        assert [privact.leak_verdict(judge.answer(chat[0]["content"])) for chat in leak_chats] == [leaks]
        assert privact.help_verdict(judge.answer(help_chat[0]["content"])) == helpfulness
    with pytest.raises(ValueError):
        judge.answer("Hello")


def test_the_trl_recipe_renders_each_prompt_as_privact_does(real_backbones, tmp_path):
    """trl_dpo.py hands TRL each prompt as privact renders it: Llama-3.2's on privact's chat date, Mistral's (which
    refuses a system role) with the system line folded in; TRL's chat-template step renders both to privact's text."""
    trl_data = pytest.importorskip("trl.data_utils", reason="pip install trl")
    from transformers import AutoTokenizer

    import trl_dpo

    pairs = tmp_path / "pairs_refiner.jsonl"
    rows = write_pairs(pairs, "refiner", 2)
    for name in ("Llama-3.2-1B-Instruct", "Mistral-7B-Instruct-v0.2"):
        tok = AutoTokenizer.from_pretrained(real_backbones[name])
        dataset = trl_dpo.as_privact_renders(trl_dpo.conversational(str(pairs)), tok)
        for row, pair in zip(dataset, rows, strict=True):
            assert trl_data.maybe_apply_chat_template(row, tok)["prompt"] == privact.chat_text(tok, pair["prompt"])


@pytest.mark.slow
def test_the_trl_recipe_trains_whole_pairs_and_moves_as_privact_does(tmp_path, tiny_model):
    """trl_dpo.py on two refiner pairs on a real case's prompt at privact's settings (whole pairs, beta 0.4, float32,
    the refiner's 4 epochs) but lr 1e-4, one micro-batch, two steps, the tiny model: TRL's first step sits at log 2,
    its second moves as far as privact's own (about 0.16 nats; at lr 5e-7 both would move 1e-3)."""
    pytest.importorskip("trl")
    pairs = tmp_path / "pairs_refiner.jsonl"
    chat = privact.build_chat(
        "refiner", privact.load_cases("", "train", 1)[0], [("generator", "Thought: x"), ("verifier", "ok")]
    )
    for n in range(2):
        row = {"case": "c", "role": "refiner", "prompt": chat, "rejected": "Thought: Alice " * 9}
        with open(pairs, "a") as fh:
            fh.write(json.dumps({**row, "chosen": "Thought: keep it private " * (n + 2)}) + "\n")
    settings = ["--model", tiny_model, "--lr", "1e-4", "--warmup-ratio", "0", "--max-steps", "2"]
    settings += ["--batch-size", "2", "--grad-accum", "1"]
    result, _ = run_bench("trl_dpo.py", "--pairs", pairs, "--out", tmp_path / "trl", *settings)
    assert privact.main(["train", "--pairs", str(pairs), "--out", str(tmp_path / "ours"), *settings]) == 0
    ours = [row["train/loss"] for row in read_json(tmp_path / "ours" / "train_metrics.json")["history"]]
    theirs = [step["loss"] for step in result["steps"]]
    assert (
        result["epochs"] == 4  # the refiner's, as privact's train
        and theirs[0] == pytest.approx(0.6931, abs=1e-4)
        and 0.6931 - ours[1] > 0.1
        and theirs[1] == pytest.approx(ours[1], abs=1e-3)
    )


@pytest.mark.slow
def test_bench_judge_serves_the_local_judges_verdicts():
    """bench_judge.py: the same leaves judged by SmolLM2 loaded here and behind a real `transformers serve` with
    continuous batching (float32, through --judge-url's path): every verdict text the same."""
    needs_smollm2()
    needs_serving()
    small = ("--cases", "1", "--leaves", "2", "--judge-max-new-tokens", "8")
    result, _ = run_bench("bench_judge.py", *small, "--arms", "serve")
    equal, calls = map(int, result["serve"]["verdicts_equal_to_local"].split("/"))
    assert calls == result["judge_calls"] > 0 and equal == calls


@pytest.mark.slow
def test_bench_shared_cpu_times_one_and_two_processes_quiet_and_beside_a_busy_one():
    """bench_shared_cpu.py --tiny on the arms of its two launch paths (one process under a wait policy, two under
    torchrun), quiet and beside a busy process: every run timed, the same records (it exits otherwise)."""
    arms = ("--arms", "passive,two-processes")
    result, _ = run_bench("bench_shared_cpu.py", "--tiny", *arms, "--burners", "1", "--limit", "100")
    for condition in ("quiet", "loaded"):
        assert set(result["seconds"][condition]) == {"passive", "two-processes"}


@pytest.mark.slow
def test_gpu_run_prepares_installs_and_runs_the_paper_preset_in_tiny_mode(tmp_path):
    """gpu_run.sh as on the GPU machine, in --tiny: prepare downloads the carried wheels and saves the tokenizer; run
    installs them into a private folder and runs bench_gpu.py --paper --tiny: every stage, and the hours."""
    needs_smollm2()
    script = str(HERE / "benchmarks" / "gpu_run.sh")
    carry, out = tmp_path / "carry", tmp_path / "out"
    env = {**os.environ, "PYVER": f"{sys.version_info[0]}.{sys.version_info[1]}"}
    prepared = subprocess.run([script, "prepare", str(carry)], env=env, capture_output=True, text=True, timeout=600)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    ran = subprocess.run([script, "run", str(carry), str(out), "--tiny"], capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stdout[-3000:]
    result = read_json(out / "bench_gpu.json")
    assert result["args"]["paper"] and result["skipped_for_time"] == [] and result["cut_by_interrupt"] is None
    assert (
        result["peers"]["speedup"] > 0 and result["train"]["pairs_per_s"] > 0 and result["hours"][-1]["job"] == "total"
    )
