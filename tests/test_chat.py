import pytest

from tests.conftest import CHATML, make_tiny_tokenizer
from trainer.data.chat import BadRecord, normalize, tokenize_chat

# A second, differently shaped template (Llama-3 style headers, no system default,
# end-of-turn inside the header scheme) to show the span logic is template-agnostic.
LLAMA3_STYLE = (
    "{{ '<|endoftext|>' }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '<|im_end|>\n\n'"
    " + message['content'] | trim + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>\n\n' }}{% endif %}"
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "How can I help you today?"},
]


def _masked_text(tok, t):
    """Decoded runs of masked tokens."""
    runs, cur = [], []
    for i, m in zip(t.input_ids, t.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.mark.parametrize("template", [CHATML, LLAMA3_STYLE], ids=["chatml", "llama3-style"])
def test_loss_mask_is_exactly_the_assistant_turns(template):
    tok = make_tiny_tokenizer(template)
    t = tokenize_chat(tok, CHAT, max_length=512)
    assert len(t.input_ids) == len(t.loss_mask)
    assert _masked_text(tok, t) == ["Paris is the capital of France.<|im_end|>",
                                    "How can I help you today?<|im_end|>"]
    # the rendered prompt is unchanged by tokenization: ids decode to the template's text
    assert tok.decode(t.input_ids) == tok.apply_chat_template(CHAT, tokenize=False)


def test_too_long_is_a_bad_record(tiny_tokenizer):
    with pytest.raises(BadRecord) as err:
        tokenize_chat(tiny_tokenizer, CHAT, max_length=10)
    assert err.value.reason == "too_long"


@pytest.mark.parametrize("record, reason", [
    ({"conversations": []}, "empty"),
    ({"id": "x"}, "empty"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": ["a", "list"]}]}, "non_string_content"),
    ({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "yo"}]}, "no_assistant"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "non_alternating"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "system", "content": "late"}]}, "non_alternating"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant"),
    ({"__invalid_json__": "line 3: Expecting value"}, "invalid_json"),
])
def test_bad_records_are_named_by_reason(record, reason):
    with pytest.raises(BadRecord) as err:
        normalize(record)
    assert err.value.reason == reason


def test_sharegpt_roles_and_trailing_user_turn():
    from collections import Counter

    dropped = Counter()
    m = normalize({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                     {"from": "human", "value": "unanswered"}]}, dropped)
    assert m == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert dropped == {"trailing_user_dropped": 1}


def test_a_leading_assistant_turn_is_dropped_and_the_conversation_kept():
    """As FastChat and EAGLE preprocess ShareGPT: the answer to no question goes, the chat stays."""
    from collections import Counter

    dropped = Counter()
    m = normalize({"conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "hello"},
                                     {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, dropped)
    assert m == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                 {"role": "assistant", "content": "a"}]
    assert dropped == {"leading_assistant_dropped": 1}


@pytest.mark.slow
def test_smollm2_template_mask(smollm2):
    tok = smollm2.tokenizer
    t = tokenize_chat(tok, CHAT[1:], max_length=512)
    # SmolLM2 adds its default system prompt; only the answers (and <|im_end|>) are masked.
    assert _masked_text(tok, t) == ["Paris is the capital of France.<|im_end|>",
                                    "How can I help you today?<|im_end|>"]


def test_a_template_file_is_read_as_a_file_and_its_problems_named(tiny_target_dir, good_chats_jsonl, tmp_path, capsys):
    """Through prepare: a template file whose path holds a `{` is still a file; an empty template
    file, and a file of plain text that renders no message content, are one line each that say
    so (not "none was given", not the source's fault); no template file is changed."""
    import json

    from recipes import prepare
    from tests.test_bad_input import one_line_error
    from tests.test_nothing_lost import _unchanged

    folder = tmp_path / "templates{v2}"
    folder.mkdir()
    braced = folder / "chatml.jinja"
    braced.write_text(CHATML)
    base = [f"target={tiny_target_dir}", f"source={good_chats_jsonl}", "max_length=256"]
    _unchanged(lambda: prepare.main([*base, f"output_dir={tmp_path / 'p'}", f"chat_template={braced}"]), braced)
    assert json.loads((tmp_path / "p" / "summary.json").read_text())["chat_template"] == CHATML
    empty = tmp_path / "empty.jinja"
    empty.write_text("")
    plain = tmp_path / "plain.jinja"
    plain.write_text("hello\n")
    for path, expect in ((empty, "is empty"), (plain, "renders no message content")):
        argv = [*base, f"output_dir={tmp_path / 'q'}", f"chat_template={path}"]
        _unchanged(lambda argv=argv, path=path, expect=expect: one_line_error(capsys, prepare.main, argv, str(path),
                                                                              expect), path, good_chats_jsonl)
        assert not (tmp_path / "q").exists()
