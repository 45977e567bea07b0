"""Issue 43: long samples (prepare, capture and training take them up to the target's context;
a longer one is skipped and counted, never cut), prompts built to a context length, τ per
context bucket, and the context length above which speculation stops paying."""

import json

import pytest
import torch
import transformers
from datasets import load_from_disk

from recipes import capture, prepare
from recipes import eval as eval_recipe
from tests.conftest import GOOD_CHATS, write_jsonl
from trainer.config import CaptureConfig, PrepareConfig
from trainer.data.buckets import TOLERANCE, context_prompts, parse_buckets
from trainer.data.collate import CapturedSamples, PreparedSamples
from trainer.data.evalsets import chat_prompt_ids
from trainer.data.shards import CaptureReader
from trainer.errors import DataError
from trainer.serving import speculation_cutoff
from trainer.target import resolve_target, target_hf_dir

# a conversation of well over the tiny target's 512-token context (its tokenizer: ~1 token per 2 characters)
LONG = {"messages": [{"role": "user", "content": "Count with me, one number a line. " + " ".join(map(str, range(600)))},
                     {"role": "assistant", "content": "1 2 3 4 5"}]}


# --- prompts built to a bucket's length ------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_bucket_prompts_have_the_buckets_length_under_the_chat_template(which, tiny_tokenizer):
    """Each prompt of a bucket has between L - TOLERANCE and L tokens as the chat template renders
    it (the tiny ChatML tokenizer, and the real SmolLM2 tokenizer with its own template), and the
    prompts of a bucket differ (no shared documents)."""
    tok = tiny_tokenizer if which == "tiny" else \
        transformers.AutoTokenizer.from_pretrained(target_hf_dir(resolve_target("smollm2-135m-instruct")))
    encode = lambda texts: chat_prompt_ids(tok, texts)  # noqa: E731  (the template eval applies)
    for L in (120, 300):
        texts, ids = context_prompts(tok, encode, L, 3)
        assert all(L - TOLERANCE <= len(i) <= L for i in ids), (L, [len(i) for i in ids])
        assert ids == encode(texts)  # the ids are the texts' under the template: what eval measures
        assert len(set(texts)) == 3 and all(t.startswith("Document 1:\n") for t in texts)
    with pytest.raises(DataError, match="shorter than the question alone"):
        context_prompts(tok, encode, 8, 1)
    assert parse_buckets("4096, 1024,2048") == [1024, 2048, 4096]


# --- τ per bucket: eval per bucket == eval of each bucket's prompts on its own ------------------------------------

def test_eval_per_bucket_equals_eval_of_each_buckets_prompts(tmp_path, tiny_target_dir, capsys):
    """`eval --context-buckets` reports per bucket what `eval --dataset jsonl:` of that bucket's
    prompts alone reports (vLLM's counts, τ, per-position acceptance), and the whole run is the
    buckets' sum (two ways to the same counts)."""
    base = ["--target", str(tiny_target_dir), "--draft", "ngram", "--num-draft-tokens", "3", "--max-new-tokens", "8",
            "--num-prompts", "2", "--draft-option", "prompt_lookup_min=1", "--draft-option", "prompt_lookup_max=3"]
    eval_recipe.main([*base, "--context-buckets", "256,128", "--output-dir", str(tmp_path / "all")])
    out = capsys.readouterr().out
    assert "context  prompt tokens" in out and "in-tree, this machine:" in out
    r = json.loads((tmp_path / "all" / "report.json").read_text())
    assert [b["context"] for b in r["context_buckets"]] == [128, 256] and r["prompts"] == 4
    built = [json.loads(line) for line in (tmp_path / "all" / eval_recipe.CONTEXT_PROMPTS).read_text().splitlines()]
    for b in r["context_buckets"]:
        L = b["context"]
        assert L - 8 - TOLERANCE <= b["prompt_tokens"][0] <= b["prompt_tokens"][1] <= L - 8  # room for the answer
        mine = write_jsonl(tmp_path / f"b{L}.jsonl", [{"prompt": x["prompt"]} for x in built if x["context"] == L])
        eval_recipe.main([*base, "--dataset", f"jsonl:{mine}", "--output-dir", str(tmp_path / f"alone{L}")])
        alone = json.loads((tmp_path / f"alone{L}" / "report.json").read_text())
        assert alone["prompts"] == b["prompts"] == 2
        assert (b["counts"], b["tau"], b["cumulative_acceptance"]) == \
            (alone["counts"], alone["tau"], alone["cumulative_acceptance"])
        assert b["counts"]["num_drafts"] > 0
    whole = r["counts"]
    assert whole["num_drafts"] == sum(b["counts"]["num_drafts"] for b in r["context_buckets"])
    assert whole["accepted_per_position"] == [sum(x) for x in zip(*(b["counts"]["accepted_per_position"]
                                                                    for b in r["context_buckets"]))]
    assert set(r["context_cutoff"]) == {"pays_up_to", "plain_from", "regained"}


def test_a_bucket_longer_than_the_targets_context_is_one_line(tmp_path, tiny_target_dir, capsys):
    with pytest.raises(SystemExit):
        eval_recipe.main(["--target", str(tiny_target_dir), "--draft", "ngram", "--context-buckets", "1024",
                          "--output-dir", str(tmp_path / "ev")])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: context bucket 1024 is longer than {tiny_target_dir.name}'s context, 512 tokens "
                       "(max_position_embeddings in its config.json); use buckets up to 512")


# --- the cut-off -------------------------------------------------------------------------------------------------

def test_speculation_cutoff_from_per_bucket_throughputs():
    """By hand: speculation pays while it beats plain decoding beyond the noise (trainer/serving.py:
    >= 2% and Welch's t-test); the cut-off is the last bucket before the first where it does not."""
    def b(L, spec, plain):
        return {"context": L, "runs": spec, "plain_runs": plain}

    steady = [10.0, 10.1, 9.9]
    rows = [b(1024, [20.0, 20.2, 19.8], steady), b(2048, [15.0, 15.1, 14.9], steady),
            b(4096, [10.1, 10.0, 10.2], steady),  # +1%: inside the noise, the simpler (plain) is served
            b(8192, [6.0, 6.1, 5.9], steady)]
    assert speculation_cutoff(rows) == {"pays_up_to": 2048, "plain_from": 4096, "regained": []}
    assert speculation_cutoff(rows[::-1]) == {"pays_up_to": 2048, "plain_from": 4096, "regained": []}  # any order
    assert speculation_cutoff(rows[:2]) == {"pays_up_to": 2048, "plain_from": None, "regained": []}  # pays throughout
    assert speculation_cutoff([b(1024, [9.0], [10.0]), b(2048, [12.0], [10.0])]) == \
        {"pays_up_to": None, "plain_from": 1024, "regained": [2048]}  # never at the shortest: a recovery is noted
    # a gain of 5% with a wide spread is not beyond the noise
    assert speculation_cutoff([b(1024, [10.5, 14.0, 7.0], [10.0, 10.1, 9.9])])["plain_from"] == 1024


# --- long samples: prepare, capture, training -----------------------------------------------------------------

def test_prepare_takes_up_to_the_targets_context_and_counts_what_is_longer(tmp_path, tiny_target_dir, capsys):
    """max_length null is the target's context (the tiny target's 512, read from its config): a
    longer conversation is skipped and counted (never cut), and one line names the limit."""
    src = write_jsonl(tmp_path / "c.jsonl", [GOOD_CHATS[0], LONG, GOOD_CHATS[1]])
    prepare.main([f"output_dir={tmp_path / 'p'}", f"target={tiny_target_dir}", f"source={src}"])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert summary["max_length"] == 512 and summary["max_length_from"].startswith("the target's context")
    assert summary["kept"] == 2 and summary["skipped"] == {"too_long": 1}
    assert "1 conversations longer than max_length 512 tokens (the target's context (max_position_embeddings)) " \
           "skipped, not cut (reason too_long)" in out
    with pytest.raises(DataError, match=r"max_length 600 is longer than .*'s context, 512 tokens"):
        prepare.run(PrepareConfig(output_dir=str(tmp_path / "q"), target=str(tiny_target_dir), source=str(src),
                                  max_length=600))


def test_capture_skips_and_counts_samples_over_its_limit(tmp_path, tiny_target_dir, capsys):
    """A prepared sample longer than capture's max_length is skipped, counted in the manifest and
    named in one line; the samples kept are captured whole."""
    src = write_jsonl(tmp_path / "c.jsonl", GOOD_CHATS * 2)
    prepare.run(PrepareConfig(output_dir=str(tmp_path / "p"), target=str(tiny_target_dir), source=str(src)))
    lengths = list(load_from_disk(str(tmp_path / "p" / "data"))["length"])
    limit = sorted(lengths)[len(lengths) // 2]
    over = sum(n > limit for n in lengths)
    assert 0 < over < len(lengths)
    m = capture.run(CaptureConfig(data=str(tmp_path / "p"), output_dir=str(tmp_path / "cap"),
                                  target=str(tiny_target_dir), max_length=limit, draft_vocab_size=64))
    assert f"capture: {over} of {len(lengths)} prepared samples are longer than max_length {limit} tokens " \
           "(max_length; the longest" in capsys.readouterr().err
    assert m["samples"] == len(lengths) - over
    assert m["too_long"] == {"max_length": limit, "from": "max_length", "skipped": over,
                             "longest_skipped": max(lengths)}
    assert sorted(CaptureReader(tmp_path / "cap").lengths()) == sorted(n for n in lengths if n <= limit)  # whole
    # null: the target's context, which every sample here fits
    m = capture.run(CaptureConfig(data=str(tmp_path / "p"), output_dir=str(tmp_path / "all"),
                                  target=str(tiny_target_dir), draft_vocab_size=64))
    assert m["samples"] == len(lengths) and m["too_long"]["skipped"] == 0 and m["too_long"]["max_length"] == 512


def test_training_skips_samples_longer_than_max_length_never_cuts_them(tiny_capture):
    """Training's max_length skips a longer sample (counted) where it used to cut it; null keeps
    every sample whole. Offline (a capture) and online (prepared samples) alike."""
    reader = CaptureReader(tiny_capture)
    lengths = reader.lengths()
    limit = sorted(lengths)[len(lengths) // 2]
    data = CapturedSamples(tiny_capture, limit)
    assert data.skipped == sum(n > limit for n in lengths) > 0 and len(data) + data.skipped == len(lengths)
    assert all(len(data[i]["input_ids"]) <= limit for i in range(len(data)))
    kept = [i for i, n in enumerate(lengths) if n <= limit]
    assert all(torch.equal(data[j]["aux_hidden_states"], reader[i]["aux_hidden_states"]) for j, i in enumerate(kept))
    whole = CapturedSamples(tiny_capture, None)
    assert whole.skipped == 0 and [len(whole[i]["input_ids"]) for i in range(len(whole))] == lengths
    ds = load_from_disk(str(tiny_capture.parent / "prepared" / "data"))
    online = PreparedSamples(ds, limit)
    assert online.skipped == sum(n > limit for n in ds["length"]) > 0
    assert [len(online[i]["input_ids"]) for i in range(len(online))] == [n for n in ds["length"] if n <= limit]


def test_the_cutoff_goes_into_the_serving_config_and_the_card_with_what_vllm_can_do():
    """compare --context-buckets: the serving policy and each load's serving config carry the
    cut-off and say that no vLLM setting acts on it (none exists in 0.32 or 0.34: export/policy.py
    VLLM_CONTEXT); the model card states the length."""
    from export import policy

    row = {"candidate": "eagle3 BF16 (x)", "concurrency": 1, "pays_up_to": 2048, "plain_from": 4096, "regained": [],
           "buckets": [{"context": 2048, "n": 3, "tokens_per_s": 30.0, "plain_tokens_per_s": 20.0},
                       {"context": 4096, "n": 1, "tokens_per_s": 15.0, "plain_tokens_per_s": 16.0}]}
    report = {"context_buckets": [{"context": 2048}, {"context": 4096}], "context_cutoffs": [row]}
    assert policy.context_note(report, "no speculation", 1) == {} and policy.context_note({}, "x") == {}
    one = policy.context_note(report, "eagle3 BF16 (x)", 1)["context_cutoff"]
    assert (one["pays_up_to"], one["plain_from"], one["in_vllm"]) == (2048, 4096, policy.VLLM_CONTEXT)
    made = {"format": policy.FORMAT, "measured": {}, **policy.context_note(report, "eagle3 BF16 (x)")}
    card = "\n".join(policy.context_card_lines(made))
    assert "| 1 | 30.0 vs 20.0 | 15.0 vs 16.0 | 2048 tokens |" in card
    assert "No setting of vLLM 0.32 or 0.34 turns drafting off above a context length" in card


def test_compare_per_bucket_reports_a_cutoff_per_candidate_and_load(tiny_target):
    """compare --context-buckets (in-tree costs, the n-gram on the tiny target): every bucket measured
    on its own prompts, a cut-off per candidate and load from its per-bucket tokens/s."""
    from recipes import compare
    from trainer.config import CompareConfig

    cfg = CompareConfig(drafts=[], context_buckets=[256, 128], num_prompts=1, max_new_tokens=6, concurrency=[1],
                        vllm=False, cost_steps=1, prompt_lookup_min=1, prompt_lookup_max=2)
    cfg.validate()
    r = compare.by_context(cfg, tiny_target, compare.make_candidates(cfg, tiny_target))
    assert [b["context"] for b in r["context_buckets"]] == [128, 256]
    assert all(b["context"] - 6 - TOLERANCE <= b["prompt_tokens"] <= b["context"] - 6 for b in r["context_buckets"])
    (cut,) = r["context_cutoffs"]
    assert cut["concurrency"] == 1 and [b["context"] for b in cut["buckets"]] == [128, 256]
    assert cut == {**cut, **speculation_cutoff([{"context": b["context"], "runs": [b["tokens_per_s"]],
                                                  "plain_runs": [b["plain_tokens_per_s"]]} for b in cut["buckets"]])}
    assert r["context_cutoff_in_vllm"].startswith("no setting of vLLM 0.32 or 0.34")
