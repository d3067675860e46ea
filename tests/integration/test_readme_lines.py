"""The README's `kvblend server` and `vllm serve` lines and docs/lmcache.md's LMCache recipe, run verbatim (docs and code cannot drift).

Also ../shared/cases/separator-in-context.md through the real server: passages ingested on
their own are hit by a chat completion whose user message is one string
``⟨sep⟩p1⟨sep⟩p2⟨sep⟩p3⟨sep⟩question``, and again in another order.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from cluster.workloads.local_ray import end_ray_node
from tests.serving import http_server

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
#: the page holding the LMCache recipe's blocks (``lmcache-serve``)
LMCACHE_DOC = "docs/lmcache.md"


def readme_block(marker: str, lang: str = "bash", doc: str = "README.md") -> str:
    """The ``lang`` code block between ``<!-- marker:begin -->`` and ``<!-- marker:end -->`` of
    ``doc`` (a path from the repository root), bash continuations joined."""
    text = (ROOT / doc).read_text()
    block = text.split(f"<!-- {marker}:begin -->", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]
    code = block.split(f"```{lang}", 1)[1].split("```", 1)[0]
    return code.replace("\\\n", " ").strip() if lang == "bash" else code


def _env() -> dict:
    env = dict(os.environ)
    # tests/cluster/vllm's in-process engines set this in our environment; a user's shell has it unset.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # The README's lines run with nothing the README does not show (issue 21): its `vllm serve`
    # sizes the KV cache itself (--gpu-memory-utilization), not through this variable.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    return env


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def readme_cluster(smollm2_path):
    server_line = readme_block("kvblend-server")
    assert server_line.startswith("kvblend server ")
    # the shard's disk directory follows the machine's name (issue 18), so a previous run's
    # chunks would be found again: start from an empty disk tier, as on a fresh machine
    disk = re.search(r"--disk-path (\S+)", server_line)
    if disk:
        import shutil

        shutil.rmtree(disk.group(1), ignore_errors=True)
    # the line as pasted starts its head under Ray's default temp dir, which is this module's
    # own RAY_TMPDIR (tests/conftest.py): its processes are ended by that, never `ray stop`,
    # which would end every Ray cluster on the machine
    temp_dir = os.path.join(os.environ["RAY_TMPDIR"], "ray")
    r = subprocess.run(["bash", "-c", server_line], env=_env(), capture_output=True, text=True, timeout=300)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield server_line
    finally:
        subprocess.run(["bash", "-c", "kvblend stop"], env=_env(), capture_output=True, timeout=120)
        end_ray_node(temp_dir)


@pytest.fixture(scope="module")
def readme_vllm(readme_cluster, tmp_path_factory):

    line = readme_block("vllm-serve")
    assert line.startswith("vllm serve ")
    port = int(re.search(r"--port (\d+)", line).group(1))
    log_path = tmp_path_factory.mktemp("vllm") / "serve.log"
    with http_server(["bash", "-c", line], _env(), log_path, port, ready_s=300) as (url, _proc):
        yield url


def test_kvblend_status_shows_the_readme_cluster(readme_cluster):
    r = subprocess.run(["bash", "-c", "kvblend status --json"], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "kvblend-shard-" in r.stdout


@pytest.fixture
def readme_lmcache_vllm(readme_cluster, tmp_path):
    """The LMCache recipe (docs/lmcache.md, linked from the README): its ``blending.yaml``
    written to a folder, its ``vllm serve`` line run there as pasted (function-scoped: stopped
    before ``readme_vllm`` starts)."""
    (tmp_path / "blending.yaml").write_text(readme_block("lmcache-serve", "yaml", doc=LMCACHE_DOC))
    line = readme_block("lmcache-serve", doc=LMCACHE_DOC)
    assert line.startswith("LMCACHE_CONFIG_FILE=blending.yaml vllm serve ")
    port = int(re.search(r"--port (\d+)", line).group(1))
    with http_server(["bash", "-c", line], _env(), tmp_path / "serve.log", port, ready_s=400,
                     cwd=tmp_path) as (url, _proc):
        yield url


def test_lmcache_blend_recipe_hits_every_chunk(readme_lmcache_vllm, smollm2_path):
    """Issue 21: LMCache's documented blend flow (examples/blend_kv_v1: ``blending.yaml``
    through ``LMCACHE_CONFIG_FILE``, ``blend_online_client.py`` over the OpenAI completions
    API) hits through docs/lmcache.md's ``vllm serve --tokenizer-mode kvblend``: precompute
    ``sys # # chunk1``, ``chunk2`` and ``chunk3``, then ``sys # # chunk2 # # chunk1 # # chunk3
    # # question`` as one string hits the system prompt and all three chunks, and at ratio 1.0
    answers as full prefill does; the same prompt tokenized as one string misses chunks; a
    prompt with no system prompt has its first passage reused in another position."""
    import requests
    from openai import OpenAI
    from transformers import AutoTokenizer

    url = readme_lmcache_vllm
    sep = " # # "
    system = "You are a very helpful assistant."
    chunks = ["Hello, how are you?" * 40, "Hello, what's up?" * 40, "Hey, how can i do" * 40]
    fresh = "Good morning, dear friend of the harbor." * 25
    client = OpenAI(base_url=url + "/v1", api_key="EMPTY")
    model = client.models.list().data[0].id

    def complete(prompt, params=None, salt=None) -> str:
        extra = {"kv_transfer_params": params} if params else {}
        if salt:
            extra["cache_salt"] = salt
        out = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, top_p=0.95,
                                        extra_body=extra or None)
        return out.choices[0].text

    def counter(name: str) -> float:
        return _metric(requests.get(url + "/metrics", timeout=10).text, f"vllm:kvblend_{name}_total")

    def cluster_puts() -> int:
        """Chunks the README's cluster accepted (every shard's ``puts``, from ``kvblend status
        --json``): the store's own count. vLLM's ``stored_chunks`` counter is not used to wait:
        it reaches ``/metrics`` with an engine step, and a put that finishes after the engine's
        last step is published only with the next request's."""
        r = subprocess.run(["bash", "-c", "kvblend status --json"], env=_env(), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        shards = json.loads(r.stdout)["shards"].values()
        return sum(int(s.get("counters", {}).get("puts", 0)) for s in shards)

    def wait(check, what: str, timeout_s: float = 120.0) -> None:
        deadline = time.time() + timeout_s  # a hang guard, not a timing assertion
        while not check():
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.5)

    def hits_of(prompt, at_least: int, params=None) -> tuple[float, str]:
        before = counter("hit_segments")
        text = complete(prompt, params)
        deadline = time.time() + 20  # vLLM's stats loop publishes a step's counters a little later
        while counter("hit_segments") - before < at_least and time.time() < deadline:
            time.sleep(0.5)
        return counter("hit_segments") - before, text

    # LMCache's precompute requests (the system prompt and chunk1 from the first, each whole
    # prompt from the others)
    for prompt in (system + sep + chunks[0], chunks[1], chunks[2]):
        complete(prompt)
    wait(lambda: cluster_puts() >= 4, "the four precomputed segments to be stored")

    blend = system + sep + chunks[1] + sep + chunks[0] + sep + chunks[2] + sep + "Hello, how are you?"
    blend_hits, text = hits_of(blend, 4)
    assert blend_hits == 4, f"{blend_hits} hit segments (want the system prompt + 3 chunks)"
    assert text
    # the oracle: with every token recomputed a blend answers as full prefill does. A blend's
    # KV (approximate below ratio 1.0) enters vLLM's prefix cache like any computed block, so a
    # later request with the same leading tokens would read it: the check takes an order of the
    # chunks no request has sent, and full prefill runs under a cache_salt of its own (no block
    # and no chunk shared with the blend), first
    oracle = system + sep + chunks[2] + sep + chunks[1] + sep + chunks[0] + sep + "Hello, how are you?"
    full = complete(oracle, {"kvblend_load": False, "kvblend_store": False}, salt="oracle-completion")
    r1_hits, r1_text = hits_of(oracle, 4, {"kvblend_recompute_ratio": 1.0})
    assert r1_hits == 4, f"{r1_hits} hit segments at ratio 1.0 (want the system prompt + 3 chunks)"
    assert r1_text == full

    # the control: the same prompt as vLLM's hf mode tokenizes it, one string
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    whole_hits, _ = hits_of(tokenizer(blend)["input_ids"], 1)
    assert whole_hits < 4, f"whole-string ids hit {whole_hits} segments"

    # no system prompt: the first passage is missed and stored as a chunk ...
    before = cluster_puts()
    complete(fresh + sep + chunks[1] + sep + "Which greeting?")
    wait(lambda: cluster_puts() > before, "the first passage to be stored")
    # ... then reused in second position, with a stored chunk in first position
    reuse_hits, _ = hits_of(chunks[1] + sep + fresh + sep + chunks[2] + sep + "Which greeting?", 3)
    assert reuse_hits == 3, f"{reuse_hits} hit segments (want chunk2 first, the first passage, chunk3)"

    # issue 35, through the chat API and --tokenizer-mode kvblend: a system message and a user
    # message `chunk # # chunk # # chunk # # question` (no leading separator) hit the three
    # chunks, the first included, and at ratio 1.0 answer as full prefill does (the oracle as
    # above: an order never sent, full prefill first under its own cache_salt)
    def chat(order, params=None, salt=None) -> tuple[float, str]:
        extra = {"kv_transfer_params": params} if params else {}
        if salt:
            extra["cache_salt"] = salt
        before = counter("hit_segments")
        out = client.chat.completions.create(
            model=model, max_tokens=10, temperature=0, extra_body=extra or None,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": sep.join([chunks[i] for i in order] + ["Which greeting?"])}])
        deadline = time.time() + 20  # vLLM's stats loop publishes a step's counters a little later
        while not salt and counter("hit_segments") - before < 3 and time.time() < deadline:
            time.sleep(0.5)
        return counter("hit_segments") - before, out.choices[0].message.content

    chat_hits, _ = chat((2, 0, 1))
    assert chat_hits >= 3, f"{chat_hits} hit segments in a chat (want the 3 chunks, the first included)"
    _, full = chat((1, 2, 0), {"kvblend_load": False, "kvblend_store": False}, salt="oracle-chat")
    r1_hits, r1_text = chat((1, 2, 0), {"kvblend_recompute_ratio": 1.0})
    assert r1_hits >= 3, f"{r1_hits} hit segments in a chat at ratio 1.0"
    assert r1_text == full


def test_separator_in_context(readme_vllm, tmp_path):
    """Passages ingested standalone are hit from one whole-string chat message, in two orders."""
    import requests

    from cluster.workloads.qa import load_examples, resolve_dataset

    ex = load_examples(resolve_dataset("wikimqa"), limit=1)[0]
    passages = list(ex.passages[:3])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in passages))
    r = subprocess.run(["bash", "-c", f"kvblend ingest --data {corpus}"], env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ingested 3 passages" in r.stdout

    sep = "\n# #\n"

    names = ("vllm:external_prefix_cache_hits_total", "vllm:kvblend_hit_segments_total",
             "vllm:kvblend_blend_requests_total")

    def metrics() -> list[float]:
        text = requests.get(readme_vllm + "/metrics", timeout=10).text
        return [_metric(text, n) for n in names]

    def ask(order):
        user = sep + sep.join(passages[i] for i in order) + sep + f"Question: {ex.question}"
        before = metrics()
        resp = requests.post(readme_vllm + "/v1/chat/completions", timeout=600, json={
            "model": "model", "max_tokens": 8, "temperature": 0.0,
            "messages": [{"role": "user", "content": user}]})
        assert resp.status_code == 200, resp.text
        deadline = time.time() + 30  # vLLM's stats loop publishes the step's counters
        while True:
            delta = [a - b for a, b in zip(metrics(), before, strict=True)]
            if delta[1] >= 3 or time.time() > deadline:
                break
            time.sleep(0.5)
        return delta, resp.json()["choices"][0]["message"]["content"]

    passage_tokens = 3 * 200  # each passage is hundreds of tokens; claimed tokens cover them
    (claimed, hit_segments, blended), answer = ask([0, 1, 2])
    assert claimed >= passage_tokens, f"connector claimed only {claimed} tokens"
    # our counters on vLLM's /metrics (the connector's Prometheus hooks)
    assert (hit_segments, blended) == (3, 1)
    assert "# #" not in answer
    (claimed2, hit_segments2, _), _ = ask([2, 0, 1])
    # the 3 passages, and the chat template's head (the first segment, stored by the first
    # request) once its store has landed
    assert claimed2 >= passage_tokens and hit_segments2 in (3, 4)


def test_chat_passages_hit_in_every_position(readme_vllm, tmp_path):
    """Issue 35, through the README's `vllm serve` (vLLM's default tokenizer mode, the default
    separator) and the OpenAI client's chat API, the shape RAG clients send: a system message
    and a user message ``passage ⟨sep⟩ passage ⟨sep⟩ passage ⟨sep⟩ question``, no leading
    separator. Passages ingested alone hit in first, middle and last position; the system
    message, stored by the first chat, hits as its own segment; the latest user message of a
    multi-turn conversation keeps hitting. (This server ignores request overrides, the default:
    the ratio-1.0 check of a chat is in the LMCache recipe's test, whose server allows them.)"""
    import requests
    from openai import OpenAI

    from cluster.workloads.qa import load_examples, resolve_dataset

    ex = load_examples(resolve_dataset("wikimqa"), limit=2)[1]
    passages = list(ex.passages[:3])
    corpus = tmp_path / "kb.jsonl"
    corpus.write_text(json.dumps({"passages": passages}) + "\n")  # a knowledge base: no question
    r = subprocess.run(["bash", "-c", f"kvblend ingest --data {corpus}"], env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "ingested 3 passages" in r.stdout, r.stdout + r.stderr

    sep = "\n# #\n"
    system = "Answer the question from the passages. Reply with a short phrase."
    client = OpenAI(base_url=readme_vllm + "/v1", api_key="EMPTY")

    def hits() -> float:
        return _metric(requests.get(readme_vllm + "/metrics", timeout=10).text, "vllm:kvblend_hit_segments_total")

    def chat(messages, params=None, want: int = 0) -> tuple[float, str]:
        before = hits()
        out = client.chat.completions.create(model="model", messages=messages, max_tokens=8, temperature=0,
                                             extra_body={"kv_transfer_params": params} if params else None)
        deadline = time.time() + 30  # vLLM's stats loop publishes the step's counters (a hang guard)
        while hits() - before < want and time.time() < deadline:
            time.sleep(0.5)
        return hits() - before, out.choices[0].message.content

    def rag(order, question=ex.question) -> list[dict]:
        user = sep.join([passages[i] for i in order] + [f"Question: {question}"])
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    got, _ = chat(rag([0, 1, 2]), want=3)
    assert got == 3, f"{got} hit segments: the 3 passages, the first one in first position"
    deadline = time.time() + 120  # the system message's store (a hang guard)
    while True:
        got, answer = chat(rag([2, 0, 1]), want=4)
        if got == 4 or time.time() > deadline:
            break
        time.sleep(1)
    assert got == 4, f"{got} hit segments: the system message and the 3 passages in another order"
    assert answer
    got, _ = chat(rag([1, 2, 0], "Which passage comes last?"), want=4)
    assert got == 4

    turn2 = rag([0, 1, 2]) + [{"role": "assistant", "content": answer},
                              {"role": "user", "content": sep.join([passages[2], passages[0], "And the other one?"])}]
    got, _ = chat(turn2, want=2)
    assert got >= 2, f"{got} hit segments in the second turn (its 2 passages at least)"


def readme_requests() -> list[str]:
    """The README's request examples: its ``bash`` blocks that start with ``curl``, as pasted."""
    blocks = [b.split("```", 1)[0] for b in (ROOT / "README.md").read_text().split("```bash\n")[1:]]
    return [b.strip() for b in blocks if b.startswith("curl ")]


def test_readme_requests_answer(readme_vllm):
    """The README's completions and chat examples, run as pasted against its `vllm serve`
    (port 8000): each answers, as an OpenAI completion and a chat completion, and the connector
    looked both up (``vllm:kvblend_requests_total``)."""
    import requests

    cmds = readme_requests()
    assert [c.split()[2] for c in cmds] == ["localhost:8000/v1/completions",
                                            "localhost:8000/v1/chat/completions"], cmds
    assert readme_vllm.endswith(":8000")

    def looked_up() -> float:
        return _metric(requests.get(readme_vllm + "/metrics", timeout=10).text, "vllm:kvblend_requests_total")

    before = looked_up()
    answers = []
    for cmd in cmds:
        r = subprocess.run(["bash", "-c", cmd], env=_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        answers.append(json.loads(r.stdout))
    assert [a["object"] for a in answers] == ["text_completion", "chat.completion"], answers
    assert answers[0]["choices"][0]["text"].strip()
    assert answers[1]["choices"][0]["message"]["content"].strip()
    deadline = time.time() + 30  # vLLM's stats loop publishes the step's counters
    while looked_up() - before < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert looked_up() - before == 2
