"""`kvxfer-cli tiny-model`: write a tiny random-weight HF model for vLLM tests and demos.

Writing a model needs transformers, which kvxfer's own venv does not carry
(vLLM's venv does): where it is missing, the command runs itself again with the
vLLM venv's python (`make vllm-venv`), so it works from either venv.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
from pathlib import Path

from kvxfer._exceptions import InvalidInputError
from kvxfer.integrations.tiny_models import TinyModelSpec, write_tiny_model

EXIT_OK = 0


def run_tiny_model(args: argparse.Namespace) -> int:
    try:
        spec = TinyModelSpec(args.family, args.layers, args.sliding_window, args.seed)
    except InvalidInputError as exc:  # the spec's field, said as the flag that gave it
        flag = "--" + exc.field.replace("_", "-")
        raise InvalidInputError(flag, exc.detail) from exc
    out = _output_directory(args.out)
    if importlib.util.find_spec("transformers") is None:
        return _in_vllm_venv(spec, out)
    write_tiny_model(spec, out)
    window = "" if spec.window is None else f", sliding window {spec.window}"
    print(f"tiny {spec.family}: {spec.num_layers} layers{window}, seed {spec.seed} -> {out}")
    return EXIT_OK


def _output_directory(given: str) -> Path:
    """--out, created now: one that cannot be is a usage error before a model (or the
    vLLM venv's python) is started, not a traceback after."""
    out = Path(given).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInputError("--out", f"cannot create {out}: {exc.strerror}") from exc
    return out


def _in_vllm_venv(spec: TinyModelSpec, out: Path) -> int:
    """Run this command again under the vLLM venv's python, which has transformers."""
    from kvxfer.integrations.vllm_fleet import find_vllm_python  # noqa: PLC0415

    argv = [str(find_vllm_python()), "-m", "kvxfer.cli.main", "tiny-model"]
    argv += ["--family", spec.family, "--out", str(out), "--seed", str(spec.seed)]
    if spec.layers is not None:
        argv += ["--layers", str(spec.layers)]
    if spec.sliding_window is not None:
        argv += ["--sliding-window", str(spec.sliding_window)]
    # cwd "/": `-m` puts cwd on sys.path, where a checkout's kvxfer/ would shadow the
    # package installed in that venv.
    return subprocess.run(argv, cwd="/", check=False, timeout=600).returncode
