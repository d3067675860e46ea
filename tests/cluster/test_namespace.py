"""One namespace function for every caller (issue 18): Hub ids resolved from the local Hugging
Face cache, a fingerprint over every byte, ``hf_overrides`` and quantization in the namespace,
replicated KV heads under tensor parallelism. CPU only, no vLLM engine."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time

import pytest

import tiers.fingerprint as fp
from cluster.namespace import (
    apply_overrides,
    canonical_overrides,
    kv_heads_per_rank,
    model_id_of,
    namespace_for,
    resolve_model_path,
)
from tests.cluster.hf_cache import COMMIT, REPO, hub_cache
from tiers.keys import Namespace

pytestmark = pytest.mark.cluster


def tiny_model(folder, *, weights_bytes: int = 3 << 20, **config):
    """A model folder: a Llama-like ``config.json`` (3 KV heads) and random weight bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "num_hidden_layers": 4, "rope_theta": 100000.0, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(os.urandom(weights_bytes))
    return folder


@pytest.fixture
def fresh_memo(monkeypatch):
    """Forget this process's digests (as a new process would)."""
    monkeypatch.setattr(fp, "_memo", {})


# ---------------------------------------------------------------- Hub ids

def test_a_hub_id_resolves_from_the_local_cache(smollm2_path, tmp_path):
    hub = tmp_path / "hub"
    snap = hub_cache(hub, smollm2_path)
    assert os.path.samefile(resolve_model_path(REPO, hf_cache_dir=str(hub)), snap)
    assert os.path.samefile(resolve_model_path(REPO, COMMIT, hf_cache_dir=str(hub)), snap)
    cache = str(tmp_path / "fingerprints.json")
    by_id = namespace_for(REPO, "float32", hf_cache_dir=str(hub), fingerprint_cache=cache)
    assert by_id.model_id == REPO
    # vLLM with HF_HUB_OFFLINE=1 hands the connector the snapshot folder instead of the id
    assert namespace_for(str(snap), "float32", fingerprint_cache=cache) == by_id
    # the same bytes as the bundled folder: only the name differs
    assert namespace_for(smollm2_path, "float32", model_id=REPO, fingerprint_cache=cache) == by_id
    assert namespace_for(smollm2_path, "float32", fingerprint_cache=cache).digest() != by_id.digest()


def test_a_hub_id_not_in_the_cache_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="local Hugging Face cache"):
        resolve_model_path("Org/Missing", hf_cache_dir=str(tmp_path))
    hub_cache(tmp_path, str(tiny_model(tmp_path / "m")))
    with pytest.raises(ValueError, match="revision nope"):
        resolve_model_path(REPO, "nope", hf_cache_dir=str(tmp_path))


def test_model_id_of():
    assert model_id_of("/c/hub/models--Org--Name/snapshots/" + COMMIT) == "Org/Name"
    assert model_id_of("/c/hub/models--gpt2/snapshots/" + COMMIT + "/") == "gpt2"
    assert model_id_of("/home/u/.cache/kvblend/models/smollm2") == "smollm2"


def test_resolve_model_takes_bundled_names_folders_and_cached_hub_ids(smollm2_path, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from cluster.workloads.model import resolve_model

    snap = hub_cache(tmp_path / "hub", smollm2_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # what HF_HUB_CACHE sets
    assert os.path.samefile(resolve_model(REPO, str(tmp_path)), snap)
    assert resolve_model(smollm2_path, str(tmp_path)) == smollm2_path
    root = os.path.dirname(os.path.dirname(smollm2_path))  # <cache_dir>/models/smollm2
    assert resolve_model("smollm2", root, prepare=False) == smollm2_path
    with pytest.raises(ValueError, match="not a bundled model"):
        resolve_model("Org/Missing", str(tmp_path))


def test_online_with_the_hub_unreachable_resolves_without_network(smollm2_path, tmp_path):
    """HF_HUB_OFFLINE unset, HF_ENDPOINT a local socket that counts connections and answers
    none: the id resolves from the cache named by HF_HUB_CACHE without a single connection."""
    import socket
    import threading

    hub = tmp_path / "hub"
    snap = hub_cache(hub, smollm2_path)
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def count() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=count, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HUB_CACHE=str(hub), HF_HOME=str(tmp_path / "hf-home"),
               HF_ENDPOINT=f"http://127.0.0.1:{server.getsockname()[1]}")
    code = f"from cluster.namespace import resolve_model_path as r\nprint(r({REPO!r}))"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.close()
    assert out.returncode == 0, out.stderr
    assert os.path.samefile(out.stdout.strip(), snap)
    assert accepted == [], "the Hub endpoint was contacted"


# ---------------------------------------------------------------- fingerprint

def test_rewriting_unsampled_bytes_changes_the_namespace(smollm2_path, tmp_path, fresh_memo):
    """1 MiB rewritten at a quarter of the weights file, far from the 4 KiB ranges the old
    fingerprint sampled (start, middle, end): a new namespace, even with the mtime set back."""
    copy = tmp_path / "smollm2-copy"
    shutil.copytree(smollm2_path, copy)
    cache = str(tmp_path / "fingerprints.json")
    weights = copy / "model.safetensors"
    before = namespace_for(str(copy), "float32", model_id="smollm2", fingerprint_cache=cache)
    assert before == namespace_for(smollm2_path, "float32", fingerprint_cache=cache)
    st = os.stat(weights)
    offset = st.st_size // 4
    with open(weights, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(1 << 20)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in old[:4096]) + old[4096:])  # the first 4 KiB flipped
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p`/`rsync -t` would: ctime still moves
    after = namespace_for(str(copy), "float32", model_id="smollm2", fingerprint_cache=cache)
    assert after.model_fingerprint != before.model_fingerprint and after.digest() != before.digest()
    fp._memo.clear()  # another process, reading the JSON cache
    assert namespace_for(str(copy), "float32", model_id="smollm2", fingerprint_cache=cache) == after


def test_digests_come_from_the_json_cache(tmp_path, fresh_memo, monkeypatch):
    model = tiny_model(tmp_path / "m")
    cache = str(tmp_path / "fingerprints.json")
    first = fp.fingerprint_checkpoint(str(model), cache)
    entries = json.load(open(cache))["files"]
    assert len(entries) == 2 and all(len(e) == 4 for e in entries.values())
    fp._memo.clear()
    monkeypatch.setattr(fp, "hash_file", lambda path: pytest.fail(f"{path} hashed again"))
    assert fp.fingerprint_checkpoint(str(model), cache) == first


def test_only_what_makes_the_kv_is_fingerprinted(tmp_path):
    """Documents, bookkeeping and tokenizer files (vLLM adds them to a Hub snapshot after the
    worker's connector fingerprinted it) leave the fingerprint; config, code and the weights
    vLLM loads change it; ``*.bin`` beside safetensors is not what vLLM loads."""
    model = tiny_model(tmp_path / "m")
    first = fp.fingerprint_checkpoint(str(model))
    (model / "README.md").write_text("# a model card")
    (model / "kvblend-prepared.json").write_text('{"seconds": 24.1}')
    (model / "tokenizer.json").write_text("{}")
    (model / "generation_config.json").write_text("{}")
    (model / "pytorch_model.bin").write_bytes(b"old weights")
    (model / ".cache").mkdir()
    assert fp.fingerprint_checkpoint(str(model)) == first
    (model / "modeling_custom.py").write_text("# remote code")
    assert fp.fingerprint_checkpoint(str(model)) != first


def _fingerprint_in_a_process(args):
    path, cache = args
    return fp.fingerprint_checkpoint(path, cache)


def test_concurrent_processes_share_one_uncorrupted_cache(tmp_path):
    models = [str(tiny_model(tmp_path / f"m{i}", weights_bytes=8 << 20)) for i in range(3)]
    cache = str(tmp_path / "fp" / "fingerprints.json")
    jobs = [(m, cache) for m in models for _ in range(3)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        got = pool.map(_fingerprint_in_a_process, jobs)
    expected = [fp.fingerprint_checkpoint(m) for m in models]
    assert got == [e for e in expected for _ in range(3)]
    data = json.load(open(cache))  # whole and parseable: replaced atomically, never torn
    assert data["version"] == 1 and len(data["files"]) == 6
    assert not [n for n in os.listdir(tmp_path / "fp") if n.startswith(".fingerprints-")]


def test_hash_file_is_blake2b_of_every_byte(smollm2_path):
    """The streamed digest of the bundled 260 MB checkpoint equals BLAKE2b-256 of its bytes
    (the speed is printed, not asserted: timings on shared CI machines swing)."""
    import hashlib

    path = os.path.join(smollm2_path, "model.safetensors")
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    got = fp.hash_file(path)
    seconds = time.perf_counter() - t0
    print(f"BLAKE2b of {size / 1e6:.0f} MB: {seconds:.2f} s, {size / 1e6 / seconds:.0f} MB/s")
    with open(path, "rb") as fh:
        assert got == hashlib.blake2b(fh.read(), digest_size=32).hexdigest()


# ---------------------------------------------------------------- overrides, quantization, TP

def test_hf_overrides_are_in_the_namespace(tmp_path):
    model = str(tiny_model(tmp_path / "m"))
    plain = namespace_for(model, "float32")
    a = namespace_for(model, "float32", hf_overrides={"rope_theta": 1e6, "max_position_embeddings": 4096})
    b = namespace_for(model, "float32", hf_overrides='{"max_position_embeddings": 4096, "rope_theta": 1000000.0}')
    assert a == b and a.digest() != plain.digest()
    assert a.overrides == '{"max_position_embeddings":4096,"rope_theta":1000000.0}'
    assert a.rope == "theta=1000000.0;" and plain.rope == "theta=100000.0;"
    assert namespace_for(model, "float32", hf_overrides={"num_hidden_layers": 2}).num_layers == 2
    assert namespace_for(model, "float32", hf_overrides={}) == plain == namespace_for(model, "float32", hf_overrides="")
    with pytest.raises(ValueError, match="not JSON"):
        namespace_for(model, "float32", hf_overrides="{rope_theta: 1}")
    with pytest.raises(ValueError, match="JSON object"):
        namespace_for(model, "float32", hf_overrides="[1]")


def test_overrides_merge_into_sub_configs_and_replace_other_dicts():
    """vLLM's rules (ModelConfig._apply_dict_overrides / _update_nested) on a config.json dict."""
    cfg = {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
           "text_config": {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "x": 1},
           "quantization_config": {"quant_method": "fp8", "bits": 8}}
    apply_overrides(cfg, {"rope_scaling": {"factor": 4.0}, "text_config": {"rope_scaling": {"factor": 4.0}},
                          "quantization_config": {"quant_method": "awq"}, "dtype": "float16"})
    assert cfg["rope_scaling"] == {"factor": 4.0}  # not a sub-config: replaced
    assert cfg["text_config"] == {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "x": 1}
    assert cfg["quantization_config"] == {"quant_method": "awq"}
    assert cfg["dtype"] == "float16"


def test_callable_overrides_are_named_in_the_namespace():
    def widen(config):
        return config

    overrides, key = canonical_overrides(widen)
    assert overrides == {} and key.startswith("callable:") and key.endswith("widen")


def test_quantization_is_in_the_namespace(tmp_path):
    plain = str(tiny_model(tmp_path / "plain"))
    assert namespace_for(plain, "float32").quantization == ""
    fp8 = namespace_for(plain, "float32", quantization="fp8")
    assert fp8.quantization == "fp8" and fp8.digest() != namespace_for(plain, "float32").digest()
    awq = str(tiny_model(tmp_path / "awq", quantization_config={"quant_method": "awq", "bits": 4}))
    assert namespace_for(awq, "float16").quantization == "awq"  # the checkpoint's own, as vLLM reads it


def test_replicated_kv_heads_under_tensor_parallelism(tmp_path):
    """tp_size=6 over 3 KV heads: vLLM replicates each head on 2 ranks; one head per rank."""
    model = str(tiny_model(tmp_path / "m"))
    spaces = [namespace_for(model, "float32", tp_rank=r, tp_size=6) for r in range(6)]
    assert {ns.num_kv_heads for ns in spaces} == {1}
    assert len({ns.digest() for ns in spaces}) == 6  # each rank keys its own copy
    assert namespace_for(model, "float32", tp_rank=2, tp_size=3).num_kv_heads == 1
    assert kv_heads_per_rank(8, 2) == 4 and kv_heads_per_rank(2, 8) == 1
    with pytest.raises(ValueError, match="divide"):
        namespace_for(model, "float32", tp_rank=0, tp_size=2)


def test_namespace_construction_stays_backward_compatible():
    base = Namespace("m", "fp", "bfloat16", 2, 2, 4)
    assert (base.overrides, base.quantization) == ("", "")
    assert base == Namespace("m", "fp", "bfloat16", 2, 2, 4, rope="", tp_rank=0, tp_size=1, lora="")
    assert len({base.digest(), Namespace("m", "fp", "bfloat16", 2, 2, 4, overrides='{"a":1}').digest(),
                Namespace("m", "fp", "bfloat16", 2, 2, 4, quantization="fp8").digest()}) == 3
