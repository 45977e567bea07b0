import json

import pytest

from trainer.data.sources import read_chats
from trainer.errors import DataError


def test_truncated_json_array_reads_every_complete_record(tmp_path):
    records = [{"id": i, "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"id": 4')  # cut inside the last record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut + 5])
    it, report = read_chats(str(path))
    got = list(it)
    assert [r["id"] for _, r in got] == [0, 1, 2, 3]
    assert report.truncated and report.records_read == 4
    assert "4 complete records" in report.notes[0]


def test_complete_json_array_is_not_truncated(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([{"messages": []}, {"messages": []}]))
    it, report = read_chats(str(path))
    assert len(list(it)) == 2 and not report.truncated


def test_jsonl_with_a_broken_line_keeps_indices(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"messages": []}\nnot json\n\n{"messages": []}\n')
    it, report = read_chats(f"jsonl:{path}")
    got = list(it)
    assert [i for i, _ in got] == [0, 1, 2]
    assert "__invalid_json__" in got[1][1]


def test_a_limit_reads_no_line_past_it(tmp_path):
    # max_records=2 must not fail on what lies beyond its records: the third line is not UTF-8.
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"messages": []}\n\n{"messages": []}\n\xff\xfe not text\n')
    it, report = read_chats(f"jsonl:{path}", limit=2)
    assert [i for i, _ in it] == [0, 1] and report.records_read == 2
    with pytest.raises(DataError, match="line 4, byte"):
        list(read_chats(f"jsonl:{path}")[0])


def test_missing_source_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="not a file nor one of"):
        read_chats(str(tmp_path / "missing.jsonl"))


def test_packaged_fixture_chats_are_found_by_file():
    it, report = read_chats("mtbench-chats", limit=3)
    assert len(list(it)) == 3 and report.path.endswith("dummy_conversation.json")


@pytest.mark.slow
def test_packaged_sharegpt_is_truncated_and_every_complete_record_is_read():
    it, report = read_chats("sharegpt")
    n = sum(1 for _ in it)
    assert report.truncated
    assert n == report.records_read == 17671
