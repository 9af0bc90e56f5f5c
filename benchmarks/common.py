"""What the benchmarks share: the flags several of them take, declared once.

    ap = common.parser(__doc__, model="smollm2", batch_size=16, max_new_tokens=64)

gives an ArgumentParser with exactly those shared flags, at those defaults; each script adds its own. The tiny models
the benchmarks build are the tests' own, in conftest.py at the repository's root.
"""

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# flag -> (type, help); the default is the script's
SHARED_FLAGS = {
    "data": (str, "PrivacyLens main_data.json path or hub id (default: the bundled copy)"),
    "model": (str, "model to benchmark: a short name (smollm2, the embedded SmolLM2-135M), a hub id or a folder"),
    "batch_size": (int, "privact's sequences per generate call"),
    "max_new_tokens": (int, "agent output budget, the same for every side"),
    "judge_max_new_tokens": (int, "tokens per verdict, the same for every side (PrivacyLens: 1000)"),
    "temperature": (float, "sampling temperature (paper: 1.0)"),
    "dtype": (str, "bfloat16 (privact's default on a GPU or a CPU with bf16 units) or float32"),
    "seed": (int, "sampling seed, the same for every side"),
}


def parser(doc, **defaults):
    """An ArgumentParser whose description is the script's docstring, with the shared flags named in
    `defaults` (as keyword names: batch_size for --batch-size) at those defaults."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        kind, text = SHARED_FLAGS[name]
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=f"{text} (default: {default})")
    return ap


def serve(folder, log, device="cpu", dtype="float32", flags=(), wait_s=120):
    """Start `transformers serve FOLDER` (`flags` added, e.g. --continuous-batching) on a free 127.0.0.1
    port, output to `log` -> (process, base URL) once it answers; exits naming the log if it dies or
    does not answer in `wait_s` seconds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", folder]
    cmd += ["--device", device, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).read()
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"transformers serve exited; see {log.name}")
            time.sleep(0.1)
    proc.kill()
    sys.exit(f"transformers serve did not answer in {wait_s} s; see {log.name}")


def serving_available():
    """Whether transformers' serving extras are installed; else exit naming the pip command."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        sys.exit('needs the serving extras: pip install fastapi uvicorn "openai>=1.98" rich starlette')
