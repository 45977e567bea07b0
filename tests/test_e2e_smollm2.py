"""End to end on the real embedded target: the demo (prepare -> capture -> train ->
export BF16 + FP8 -> eval) on a small budget; the capture is checked against the target
itself, and the demo's table and serve commands are checked in its output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes import demo
from tests.conftest import REPO
from trainer.data.shards import CaptureReader

pytestmark = pytest.mark.slow
DEMO = REPO / "recipes" / "configs" / "smollm2-135m" / "demo.yaml"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    import contextlib
    import io

    out = tmp_path_factory.mktemp("demo") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        # the config `make demo` runs, on a smaller budget
        demo.main(["--config", str(DEMO), f"output_dir={out}", "prepare.max_records=100", "prepare.max_length=1024",
                   "capture.max_samples=16", "capture.samples_per_shard=8", "train.max_steps=4",
                   "train.max_length=512", "eval_prompts=2", "eval_max_new_tokens=12", "gate_prompts=2"])
    (out / "demo.out").write_text(printed.getvalue())
    return out


def test_demo_never_replaces_an_earlier_run_unless_told(demo_run, capsys):
    before = sorted(p.relative_to(demo_run) for p in demo_run.rglob("*"))
    with pytest.raises(SystemExit) as e:
        demo.main([f"output_dir={demo_run}"])
    assert e.value.code == 2
    assert "holds an earlier run; pass overwrite=true" in capsys.readouterr().err
    assert sorted(p.relative_to(demo_run) for p in demo_run.rglob("*")) == before


def test_demo_runs_the_whole_pipeline(demo_run):
    text = (demo_run / "demo.out").read_text()
    assert "[6/6]" in text and "FP8 vs BF16: τ" in text and "FP8 gate at export" in text
    for name in ("bf16", "fp8"):
        e = demo_run / f"export-{name}"
        assert (e / "eval" / "report.json").is_file() and (e / "model.safetensors").is_file()
        assert f'"model": "{e}"' in text  # the printed vllm serve command points at the export
    m = json.loads((demo_run / "export-fp8" / "draftsmith_export.json").read_text())
    assert m["quantization"]["scheme"] == "ptpc_fp8" and m["gate"]["prompts"] == 2


def test_demo_prints_and_writes_a_capture(demo_run):
    m = json.loads((demo_run / "capture" / "manifest.json").read_text())
    assert m["samples"] == 16 and len(m["shards"]) == 2
    assert m["target"]["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # one capture for both drafts: the sorted union of EAGLE-3's (2, 15, 27) and DFlash's (2, 9, 15, 21, 28)
    assert m["aux_layer_ids"] == [2, 9, 15, 21, 27, 28] and m["target"]["num_layers"] == 30
    assert m["draft_layer_ids"] == {"eagle3": [2, 15, 27], "dflash": [2, 9, 15, 21, 28], "dspark": [2, 9, 15, 21, 28]}
    assert m["layer_id_convention"] == "entering-layer"
    assert m["store_dtype"] == "bfloat16"
    # 6 aux layers + the last layer, H=576, bf16, plus int32 id, uint8 mask, int32 greedy token = 8073 bytes a token
    assert m["bytes_per_token"]["expected"] == 7 * 576 * 2 + 9
    assert m["bytes_per_token"]["on_disk"] == pytest.approx(8073, rel=0.01)
    s = json.loads((demo_run / "prepared" / "summary.json").read_text())
    assert s["records_read"] == 100 and s["kept"] >= 16
    assert s["dropped_turns"]["leading_assistant_dropped"] > 0 and "leading_assistant" not in s["skipped"]  # kept


def test_captured_states_match_the_target(demo_run, smollm2):
    reader = CaptureReader(demo_run / "capture")
    for i in (0, 15):
        s = reader[i]
        ids = s["input_ids"].long()[None]
        with torch.no_grad():
            ref = smollm2.model(ids, output_hidden_states=True)
        H = 576
        for k, layer in enumerate([2, 9, 15, 21, 27, 28]):
            torch.testing.assert_close(s["aux_hidden_states"][:, k * H:(k + 1) * H].float(),
                                       ref.hidden_states[layer][0],
                                       atol=0.05, rtol=0.02)
        logits = smollm2.logits_from_last_hidden(s["last_hidden_state"].float())
        agree = (logits.argmax(-1) == ref.logits[0].argmax(-1)).float().mean()
        assert agree > 0.97  # bf16 storage of the pre-norm state keeps the target's argmax


def test_loss_mask_covers_only_assistant_text(demo_run, smollm2):
    reader = CaptureReader(demo_run / "capture")
    tok = smollm2.tokenizer
    for i in range(len(reader)):
        s = reader[i]
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].bool().tolist()
        runs, cur = [], []
        for t, m in zip(ids, mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        assert runs, f"sample {i} has no assistant tokens"
        for r in runs:
            assert r[-1] == tok.convert_tokens_to_ids("<|im_end|>")  # each turn ends with its end-of-turn token
            assert tok.convert_tokens_to_ids("<|im_start|>") not in r
            assert not tok.decode(r).startswith("assistant\n")


def test_inspect_capture_verifies_hashes(demo_run):
    exe = Path(sys.executable).parent / "draftsmith"
    r = subprocess.run([str(exe), "inspect-capture", str(demo_run / "capture")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "all 2 shard(s) match their sha256" in r.stdout
    shard = demo_run / "capture" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = subprocess.run([str(exe), "inspect-capture", str(demo_run / "capture")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("shard-00001.safetensors does not match its size/sha256 in "
                                                         "manifest.json "
                                                         "(changed or truncated); capture again")


@pytest.mark.extended  # DFlash and DSpark are trained, exported FP8 and served by tests/test_vllm.py
@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_demo_runs_every_algorithm(tmp_path, algorithm):
    """`draftsmith demo algorithm=...` end to end on a minimal budget: the block draft is exported,
    gated and measured at the block it was trained on (DFlash: K-1 = 7, DSpark: K = 7), and the
    variants the algorithm declares (DSpark: without_markov) are in its table."""
    import contextlib
    import io

    from trainer.drafts.registry import get

    out = tmp_path / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        demo.main(["--config", str(DEMO), f"output_dir={out}", f"algorithm={algorithm}", "prepare.max_records=40",
                   "prepare.max_length=512", "capture.max_samples=6", "capture.samples_per_shard=8",
                   "train.max_steps=3", "train.max_length=512", "eval_prompts=1", "eval_max_new_tokens=10",
                   "gate_prompts=1"])
    text = printed.getvalue()
    assert "[6/6]" in text and "FP8 vs BF16: τ" in text and "FP8 gate at export" in text
    assert f'"method": "{algorithm}"' in text and '"num_speculative_tokens": 7' in text
    report = json.loads((out / "export-bf16" / "eval" / "report.json").read_text())
    assert report["num_draft_tokens"] == 7 and report["cost_model"]["parallel"] is True
    assert set(report.get("ablations", {})) == set(get(algorithm).Proposer.ABLATIONS)
    for name in get(algorithm).Proposer.ABLATIONS:
        assert f"BF16 {name}: τ" in text
