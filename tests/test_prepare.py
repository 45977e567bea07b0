import json

import pytest
from datasets import load_from_disk

from recipes import prepare
from tests.conftest import GOOD_CHATS, write_jsonl
from trainer.config import PrepareConfig, RegenerateConfig
from trainer.data.chat import normalize, render
from trainer.data.regenerate import apply_answers, regenerate
from trainer.errors import DataError

BAD = [
    {"messages": []},  # 1 empty
    {"messages": [{"role": "wizard", "content": "x"}]},  # 2 unknown_role
    {"messages": [{"role": "user", "content": 5}]},  # 3 non_string_content
    # 4 no_assistant (both dropped)
    {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},  # 5 non_alternating
    {"messages": [{"role": "user", "content": "long " * 400}, {"role": "assistant", "content": "x"}]},  # 6 too_long
    "{not json",  # 7 invalid_json
]


def _cfg(tmp_path, target, source, **kw):
    return PrepareConfig(output_dir=str(tmp_path / "prepared"), target=str(target), source=str(source),
                         max_length=256, **kw)


def test_bad_records_are_skipped_and_counted(tmp_path, tiny_target_dir):
    src = write_jsonl(tmp_path / "mixed.jsonl", [GOOD_CHATS[0], *BAD, GOOD_CHATS[1]])
    summary = prepare.run(_cfg(tmp_path, tiny_target_dir, src))
    assert summary["kept"] == 2 and summary["records_read"] == 9
    assert summary["skipped"] == {"empty": 1, "invalid_json": 1, "no_assistant": 1, "non_alternating": 1,
                                  "non_string_content": 1, "too_long": 1, "unknown_role": 1}
    ds = load_from_disk(str(tmp_path / "prepared" / "data"))
    assert list(ds["index"]) == [0, 8]
    assert all(len(i) == len(m) == n for i, m, n in zip(ds["input_ids"], ds["loss_mask"], ds["length"]))
    on_disk = json.loads((tmp_path / "prepared" / "summary.json").read_text())
    assert on_disk["skipped"] == summary["skipped"]
    for name in ("config.yaml", "command.txt", "provenance.json"):
        assert (tmp_path / "prepared" / name).is_file()


@pytest.mark.parametrize("bad_at, reason", [(2, "unknown_role"), (6, "too_long")])
def test_strict_mode_stops_naming_the_record(tmp_path, tiny_target_dir, capsys, bad_at, reason):
    src = write_jsonl(tmp_path / "mixed.jsonl", [GOOD_CHATS[0], *BAD, GOOD_CHATS[1]])
    src2 = write_jsonl(tmp_path / "one_bad.jsonl", [GOOD_CHATS[0]] * bad_at + [BAD[bad_at - 1]])
    for source, index in ((src, 1), (src2, bad_at)):
        with pytest.raises(SystemExit) as e:
            prepare.main([f"output_dir={tmp_path}/out", f"target={tiny_target_dir}", f"source={source}",
                          "max_length=256", "strict=true"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err  # progress bars may precede it; the error is one line, last
        assert err.splitlines()[-1].startswith(f"error: record {index} of ") and err.count("error:") == 1
    assert "too_long" in err or "unknown_role" in err
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert not list(tmp_path.glob(".out.*"))


def test_existing_output_needs_overwrite(tmp_path, tiny_target_dir, good_chats_jsonl):
    cfg = _cfg(tmp_path, tiny_target_dir, good_chats_jsonl)
    prepare.run(cfg)
    with pytest.raises(DataError.__mro__[1], match="already exists; pass overwrite=true"):
        prepare.run(cfg)
    cfg.overwrite = True
    assert prepare.run(cfg)["kept"] == 12


def test_num_proc_gives_the_same_dataset(tmp_path, tiny_target_dir, good_chats_jsonl):
    a = prepare.run(_cfg(tmp_path / "a", tiny_target_dir, good_chats_jsonl))
    b = prepare.run(_cfg(tmp_path / "b", tiny_target_dir, good_chats_jsonl, num_proc=2))
    assert a["tokens"] == b["tokens"]
    da = load_from_disk(str(tmp_path / "a" / "prepared" / "data"))
    db = load_from_disk(str(tmp_path / "b" / "prepared" / "data"))
    assert da["input_ids"] == db["input_ids"] and da["loss_mask"] == db["loss_mask"]


def test_regeneration_replaces_answers_with_the_targets_greedy_output(tiny_target):
    convs = [normalize(c) for c in GOOD_CHATS]
    records = regenerate(tiny_target, convs, max_new_tokens=6, max_model_len=256, batch_size=3)
    batched, skipped, _ = apply_answers(convs, records, "keep")
    tok = tiny_target.tokenizer
    assert not skipped and len(records) == sum(m["role"] == "assistant" for c in convs for m in c)
    for original, new in zip(convs, batched):
        assert [m["role"] for m in new] == [m["role"] for m in original]
        assert [m["content"] for m in new if m["role"] != "assistant"] == \
               [m["content"] for m in original if m["role"] != "assistant"]
        # batch of one (no padding) gives the same answers: left padding is exact
        j = next(k for k, m in enumerate(new) if m["role"] == "assistant")
        ids = tok(render(tok, new[:j], add_generation_prompt=True), add_special_tokens=False, return_tensors="pt")
        out = tiny_target.model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                         eos_token_id=[tok.eos_token_id])
        assert new[j]["content"] == tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_an_answer_that_ends_badly_ends_its_conversation():
    """apply_answers: an empty answer, a cut one under truncated=drop, or a prompt with no room
    ends the conversation after its last good answer (later turns counted as dropped); with no
    good answer left the conversation is skipped with that reason."""
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]
    good = {"token_ids": [5, 2], "text": "fine", "finish_reason": "stop"}
    cut = {"token_ids": [5, 6], "text": "cut", "finish_reason": "length"}
    records = [{"conv": 0, "turn": 1, **good}, {"conv": 0, "turn": 3, **cut},
               {"conv": 1, "turn": 1, **good, "text": ""},
               {"conv": 2, "turn": 1, "skip": "prompt_too_long"},
               {"conv": 3, "turn": 1, **good}, {"conv": 3, "turn": 3, **good, "text": ""}]
    convs, skipped, dropped = apply_answers([conv] * 4, records, "drop")
    assert convs[0] == [conv[0], {"role": "assistant", "content": "fine"}]
    assert convs[1] is None and convs[2] is None and convs[3] == convs[0]
    assert skipped == {1: "regenerate_empty_answer", 2: "regenerate_prompt_too_long"}
    assert dropped == {"regenerate_answer_truncated": 1, "regenerate_empty_answer": 1}
    kept, _, _ = apply_answers([conv], records[:2], "keep")  # a cut answer is kept by default
    assert kept[0][3] == {"role": "assistant", "content": "cut"}


def test_prepare_with_regeneration(tmp_path, tiny_target_dir, good_chats_jsonl):
    s = prepare.run(_cfg(tmp_path, tiny_target_dir, good_chats_jsonl,
                         regenerate=RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=4)))
    assert s["regenerated"] and s["kept"] > 0
    r = s["regenerate"]
    assert r["engine"] == "hf" and r["answers"] > 0 and r["tokens"] > 0 and r["max_new_tokens"] == 4
    lines = (tmp_path / "prepared" / "regenerated.jsonl").read_text().splitlines()
    assert len(lines) == r["answers"] + r["prompt_too_long"]
    first = json.loads(lines[0])
    assert {"index", "conv", "turn", "token_ids", "text", "finish_reason"} <= set(first)


def test_a_mixture_is_deduplicated_and_counted_per_source(tmp_path, tiny_target_dir):
    """source: a list of sources with weights: one conversation per first user turn (the first
    source's copy wins), a seeded subsample of a source with weight < 1, counts per source."""
    a = write_jsonl(tmp_path / "a.jsonl", GOOD_CHATS)  # 4 conversations
    b = write_jsonl(tmp_path / "b.jsonl", [GOOD_CHATS[0], GOOD_CHATS[1]] + [  # 2 repeats of a, then 20 new ones
        {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
        for i in range(20)])
    cfg = _cfg(tmp_path, tiny_target_dir, "x")
    cfg.source = [str(a), {"source": str(b), "weight": 0.5}]
    s = prepare.run(cfg)
    by = {x["source"]: x for x in s["sources"]}
    assert by[str(a)]["kept"] == 4 and by[str(a)]["records_read"] == 4
    taken = by[str(b)]["kept"] + by[str(b)]["skipped"].get("duplicate", 0)
    assert 0 < taken < 22 and by[str(b)]["records_read"] == 22  # about half of b, seeded
    assert s["kept"] == 4 + by[str(b)]["kept"] and s["skipped"].get("duplicate", 0) == by[str(b)]["skipped"].get(
        "duplicate", 0)
    ds = load_from_disk(str(tmp_path / "prepared" / "data"))
    assert len(set(ds["index"])) == len(ds)  # unique across the mixture
    cfg.overwrite = True
    assert prepare.run(cfg)["sources"] == s["sources"]  # the same subsample every run
