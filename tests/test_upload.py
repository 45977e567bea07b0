"""`draftsmith upload`: the dry-run plan and card offline, refusals, and a real round trip
through huggingface_hub's commit API against a local Hub-compatible server."""

import hashlib
import json
import os
import shutil

import pytest

from recipes import eval as eval_recipe
from recipes import export_draft as export_recipe
from recipes import train
from recipes import upload as upload_recipe
from tests.conftest import GOOD_CHATS, REPO, write_jsonl
from tests.hub_server import LocalHub
from trainer.config import TrainConfig, load_config

TOKEN = "hf_" + "Q" * 34  # what a real token looks like; must never be printed
BASE = ["--base-model", "test-org/tiny-llama"]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory, tiny_capture, tiny_target_dir):
    d = tmp_path_factory.mktemp("upload")
    train.run(load_config(TrainConfig, REPO / "recipes/configs/tiny/eagle3.yaml", [
        f"data={tiny_capture}", f"target={tiny_target_dir}", f"output_dir={d / 'eagle3'}", "max_steps=6"]))
    export_recipe.main(["--draft", str(d / "eagle3"), "--target", str(tiny_target_dir),
                        "--output-dir", str(d / "export")])
    prompts = write_jsonl(d / "prompts.jsonl", GOOD_CHATS)
    eval_recipe.main(["--target", str(tiny_target_dir), "--draft", str(d / "export"), "--dataset", f"jsonl:{prompts}",
                      "--num-draft-tokens", "3", "--max-new-tokens", "8", "--output-dir", str(d / "export" / "eval")])
    return d / "export"


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty login cache


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(root):
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def test_dry_run_prints_the_plan_and_card_offline(tiny_export, no_token, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    upload_recipe.main([str(tiny_export), "--repo", "me/tiny-eagle3", "--dry-run", *BASE])
    out = capsys.readouterr().out
    for rel, p in _files(tiny_export).items():  # every file: size, sha256, path
        assert f"{p.stat().st_size:>12,}  {_sha(p)}  {rel}" in out
    card = out.split("--- README.md ---\n", 1)[1].split("--- dry run", 1)[0]
    from huggingface_hub import ModelCard

    meta = ModelCard(card).data.to_dict()
    assert meta["base_model"] == "test-org/tiny-llama" and meta["library_name"] == "vllm"
    assert {"speculative-decoding", "eagle3", "vllm", "rocm"} <= set(meta["tags"]) and "fp8" not in meta["tags"]
    report = json.loads((tiny_export / "eval" / "report.json").read_text())
    assert f"| {report['tau']:.3f} |" in card  # the eval table carries the measured τ
    sampled = report["sampling"]["temperature"] > 0  # ... and how the draft sampled (vLLM's draft_sample_method)
    method = f"| {report['sampling']['draft_sampling']} |" if sampled else "| - |"
    assert "| draft sampling |" in card and method in card
    assert '"method": "eagle3", "model": "me/tiny-eagle3"' in card  # the serve command
    assert "eval/acceptance.png" in card and "## Provenance" in card and "## Training" in card
    cfg = load_config(TrainConfig, REPO / "recipes/configs/tiny/eagle3.yaml")  # what the draft trained toward, with
    assert (f"- objective `{cfg.draft.loss}` at the answers' positions; optimizer {cfg.optimizer} at "
            f"{cfg.learning_rate:g}, schedule {cfg.lr_schedule}\n") in card
    assert "nothing was uploaded" in out


def test_round_trip_through_a_local_hub(tiny_export, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with LocalHub(tmp_path / "hub", TOKEN) as hub:
        args = [str(tiny_export), "--repo", "me/tiny-eagle3", "--endpoint", hub.endpoint, *BASE]
        upload_recipe.main(args)
        first = capsys.readouterr()
        stored = tmp_path / "hub" / "me" / "tiny-eagle3" / "main"
        got = _files(stored)
        want = _files(tiny_export)
        assert set(got) == set(want) | {"README.md"}
        assert all(_sha(got[k]) == _sha(want[k]) for k in want)  # every byte arrived
        card = got["README.md"].read_text()
        assert card in first.out and "base_model: test-org/tiny-llama" in card

        with pytest.raises(SystemExit) as e:  # a second upload must not silently add to the repo
            upload_recipe.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "already exists" in err and "--exist-ok" in err
        upload_recipe.main([*args, "--exist-ok"])
        upload_recipe.main([*args, "--revision", "fp8-try"])
        assert [c["revision"] for c in hub.commits] == ["main", "main", "fp8-try"]
        out = capsys.readouterr()
    assert TOKEN not in first.out + first.err + out.out + out.err
    assert not any(TOKEN.encode() in p.read_bytes() for p in _files(tmp_path / "hub").values())


def test_no_token_and_unreachable_hub_are_one_line(tiny_export, no_token, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        upload_recipe.main([str(tiny_export), "--repo", "me/x", *BASE])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert e.value.code == 2 and len(err) == 1 and "no Hugging Face token" in err[0]

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with LocalHub(tiny_export.parent / "closed", TOKEN) as hub:  # a port that then closes
        endpoint = hub.endpoint
    with pytest.raises(SystemExit) as e:
        upload_recipe.main([str(tiny_export), "--repo", "me/x", "--endpoint", endpoint, *BASE])
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert e.value.code == 2 and len(err) == 1 and "cannot reach" in err[0]
    assert TOKEN not in captured.out + captured.err


@pytest.mark.parametrize("damage, message", [
    ("no-report", "eval/report.json is missing"),
    ("symlink", "is a symlink"),
    ("secret-name", "looks like a credential file"),
    ("secret-content", "looks like a secret"),
    ("tampered", "does not match draftsmith_export.json"),
    ("local-target", "pass --base-model"),
    ("edited-report", "does not match the sha256 `draftsmith eval` recorded"),
    ("foreign-report", "was not written by `draftsmith eval` of this export"),
    ("added-file", "holds files added after export: notes.md"),
])
def test_refusals(tiny_export, tmp_path, no_token, capsys, damage, message):
    bad = tmp_path / "export"
    shutil.copytree(tiny_export, bad)
    base = BASE
    if damage == "no-report":
        os.remove(bad / "eval" / "report.json")
    elif damage == "symlink":
        (bad / "extra.json").symlink_to(tmp_path.parent)
    elif damage == "secret-name":
        (bad / ".env").write_text("A=1\n")
    elif damage == "secret-content":
        (bad / "notes.txt").write_text(f"login with {TOKEN}\n")
    elif damage == "tampered":
        (bad / "config.json").write_text((bad / "config.json").read_text().replace('"silu"', '"gelu"'))
    elif damage == "local-target":
        base = []
    elif damage == "edited-report":  # a better τ typed in by hand must not reach a card
        r = json.loads((bad / "eval" / "report.json").read_text())
        r["tau"] = 4.2
        (bad / "eval" / "report.json").write_text(json.dumps(r))
    elif damage == "foreign-report":
        shutil.copytree(bad / "eval", bad / "eval-copied")
    elif damage == "added-file":
        (bad / "notes.md").write_text("hello\n")
    with pytest.raises(SystemExit) as e:
        upload_recipe.main([str(bad), "--repo", "me/x", "--dry-run", *base])
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert e.value.code == 2 and len(err) == 1 and message in err[0]
    assert TOKEN not in captured.err and "README.md" not in captured.out


def test_added_files_upload_only_when_told(tiny_export, tmp_path, no_token, capsys):
    bad = tmp_path / "export"
    shutil.copytree(tiny_export, bad)
    (bad / "notes.md").write_text("hello\n")
    upload_recipe.main([str(bad), "--repo", "me/x", "--dry-run", "--allow-extra-files", *BASE])
    assert "notes.md" in capsys.readouterr().out
