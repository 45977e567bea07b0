"""Online training past one process: the hf target in Ray actors (trainer/online/producer.py)
placed on the nodes of a Ray cluster by their resources, streaming to one or two trainer ranks.
The cluster is started as a user starts one (`ray start --head`, `ray start --address=...`, each
node with its own resources: real raylets, each with its own object store) on this machine:
the head is the trainer's node (the trainer's processes attach to it, and the run's channel
lives there), a second node offers `producer_node` and runs the producers, so every sample's
states cross between nodes through Ray's object store. Every sample forwarded alone (as the
in-process run with online.max_tokens_per_batch=1 does) in float32: a run is the in-process
run to the bit (the loss at every logged step, the weights and the export), with one or two
producers and one or two ranks; the producer's node taken away mid-run ends the run in one line
naming it, and the resumed run ends with the uninterrupted run's weights; a trainer that dies
takes its producers with it. Each cluster a test starts is stopped by the pids it started."""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from recipes import export_draft, prepare, train
from tests.conftest import GOOD_CHATS, REPO, write_jsonl
from trainer import faults
from trainer.config import ExportConfig, PrepareConfig, TrainConfig, load_config
from trainer.online.producer import STALL_AFTER_SAMPLES

RAY = Path(sys.executable).parent / "ray"
SMOL = REPO / "recipes" / "configs" / "smollm2-135m" / "eagle3.yaml"
TINY = REPO / "recipes" / "configs" / "tiny" / "eagle3.yaml"
# A tiny budget on the real target: 4 updates of 2 samples of at most 48 tokens, each forwarded alone
# in float32 (bitwise the same states wherever it runs), a checkpoint every update.
RUN = ["max_steps=4", "epochs=4", "batch_size=2", "gradient_accumulation_steps=1", "max_length=48",
       "log_every=1", "warmup_steps=1", "save_every=1", "draft.ttt_steps=2", "online.engine=hf",
       "online.store_dtype=float32", "online.draft_vocab_size=256", "online.max_tokens_per_batch=1",
       "online.buffer_tokens=160", "online.start_timeout_s=300"]
PRODUCER = "online.producer_resources={producer_node: 1}"
# Ray's own env for every process of these clusters: no usage stats, no auth token (a test
# cluster on loopback), a lost node noticed within seconds, one thread per torch process.
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1",
       "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
       "RAY_health_check_failure_threshold": "3", "TOKENIZERS_PARALLELISM": "false"}


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Cluster:
    """Ray nodes on this machine, each `ray start --block` in a session of its own: stopping a
    node kills the processes it started, by pid (never `ray stop`, which ends every Ray
    instance on the machine)."""

    def __init__(self):
        self.temp = tempfile.mkdtemp(prefix="ds-ray-")  # short: Ray's socket paths live under it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = None
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, resources: dict, cpus: int, head: bool = False) -> None:
        where = ["--head", f"--port={self.port}", f"--temp-dir={self.temp}", "--include-dashboard=false"] if head \
            else [f"--address={self.address}"]
        cmd = [str(RAY), "start", "--block", *where, f"--num-cpus={cpus}", "--num-gpus=0",
               f"--resources={json.dumps(resources)}", "--disable-usage-stats"]
        log = open(Path(self.temp) / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, **ENV})
        if head:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if self.address is None:
                    text = (Path(self.temp) / f"{name}.log").read_text()
                    found = [w for w in text.split() if w.startswith("--address='")]
                    self.address = found[0].split("'")[1] if found else None
                if self.address and self._alive_nodes() >= 1:
                    return
                time.sleep(0.5)
            raise RuntimeError(f"the head did not start: {(Path(self.temp) / f'{name}.log').read_text()[-2000:]}")
        self.wait_nodes(len([p for p in self.procs.values() if p.poll() is None]))

    def nodes(self) -> list[dict]:
        """The live nodes, as Ray's GCS lists them (a driver of its own: this process stays out of Ray)."""
        code = (f"import json, ray; ray.init(address={self.address!r}, log_to_driver=False); "
                "print(json.dumps([n for n in ray.nodes() if n['Alive']]))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **ENV},
                             timeout=120)
        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return []

    def _alive_nodes(self) -> int:
        return len(self.nodes())

    def wait_nodes(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self._alive_nodes() != n:
            assert time.monotonic() < deadline, f"the cluster has not {n} live nodes"
            time.sleep(0.5)

    def node_ids(self) -> dict[str, str]:
        """{custom resource name: the node id of the live node offering it}."""
        return {k: n["NodeID"] for n in self.nodes() for k in n["Resources"] if k.endswith("_node")}

    def raylet(self, name: str) -> psutil.Process:
        return next(p for p in psutil.Process(self.procs[name].pid).children(recursive=True) if p.name() == "raylet")

    def stop(self, name: str) -> None:
        """SIGKILL what node `name` started (the raylet's workers included), by pid."""
        proc = self.procs.pop(name)
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()

    def close(self) -> None:
        for name in [n for n in self.procs if n != "head"] + [n for n in self.procs if n == "head"]:
            self.stop(name)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """A head (the trainer's node) and a node offering two producers' worth of `producer_node`."""
    c = Cluster()
    try:
        c.start("head", {"trainer_node": 1}, cpus=1, head=True)
        c.start("producers", {"producer_node": 2}, cpus=1)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def smol_prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster-data")
    prepare.run(PrepareConfig(output_dir=str(d / "prepared"), target="smollm2-135m-instruct",
                              source=str(write_jsonl(d / "chats.jsonl", GOOD_CHATS * 2)), max_length=48))
    return d / "prepared"


def _launch(args, env=None, ranks: int = 1, timeout: float = 900, zero2: bool = False):
    """recipes/train.py as a user runs it: alone, or `accelerate launch` of `ranks` ranks on the CPU
    (DDP over gloo; `zero2`: DeepSpeed ZeRO-2, its CPU accelerator, as tests/test_train.py does)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(ranks), "--num_machines",
              "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if zero2:
        from tests.test_train import torch_extensions_dir

        prefix = [*launch[:3], "--config_file", str(REPO / "recipes" / "accelerate" / "zero2.yaml"), *launch[3:]]
        extra = {"TORCH_EXTENSIONS_DIR": str(torch_extensions_dir())}
    elif ranks > 1:
        prefix, extra = [*launch[:3], "--multi_gpu", *launch[3:]], {"ACCELERATE_USE_CPU": "true"}
    else:
        prefix, extra = [sys.executable], {}
    return subprocess.run([*prefix, str(REPO / "recipes" / "train.py"), *args], capture_output=True, text=True,
                          env={**os.environ, **ENV, **extra, **(env or {})}, timeout=timeout, cwd=REPO)


ZERO_OPT = ("optimizer=adamw", "learning_rate=0.0005")  # Muon, the recipe's, does not run under ZeRO


def _args(prepared, out, *extra):
    return ["--config", str(SMOL), f"data={prepared}", f"output_dir={out}", *RUN, *extra]


def _report(out) -> dict:
    return json.loads((Path(out) / "train_report.json").read_text())


def _same_run(a, b) -> None:
    """The same loss at every logged step, the same weights and the same export, to the bit."""
    ra, rb = _report(a), _report(b)
    assert [h["step"] for h in ra["history"]] == [h["step"] for h in rb["history"]] == [1, 2, 3, 4]
    assert [h["loss"] for h in ra["history"]] == [h["loss"] for h in rb["history"]]
    assert _sha(Path(a) / "model.safetensors") == _sha(Path(b) / "model.safetensors")
    for d in (a, b):  # a reference shared by several tests is exported once
        if not (Path(d).parent / f"{Path(d).name}-export" / "model.safetensors").is_file():
            export_draft.run(ExportConfig(draft=str(d), output_dir=str(Path(d).parent / f"{Path(d).name}-export")))
    assert _sha(Path(a).parent / f"{Path(a).name}-export" / "model.safetensors") == \
        _sha(Path(b).parent / f"{Path(b).name}-export" / "model.safetensors")


@pytest.fixture(scope="module")
def in_process(smol_prepared, tmp_path_factory):
    """The reference: one process, the target in it."""
    out = tmp_path_factory.mktemp("in-process") / "run"
    r = _launch(_args(smol_prepared, out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_two_nodes_train_as_one_process(cluster, smol_prepared, in_process, tmp_path):
    """The producer on the node that offers `producer_node`, the trainer on the head: the states
    cross nodes, the buffer never holds more than online.buffer_tokens (a sample more, at most,
    for the one the rank takes next), and the run is the one-process run to the bit."""
    out = tmp_path / "cluster"
    r = _launch(_args(smol_prepared, out, f"online.address={cluster.address}", PRODUCER))
    assert r.returncode == 0, r.stderr[-3000:]
    nodes = cluster.node_ids()
    line = _report(out)["final"]["online"]
    assert [p["node"] for p in line["producers"]] == [nodes["producer_node"]]
    assert line["channel_node"] == nodes["trainer_node"] != nodes["producer_node"]
    assert max(line["buffer_peak_tokens"]) <= 160 + 48
    assert line["tokens_received"] > 0 and line["trainer_wait_s"] >= 0 and line["producer_blocked_s"] >= 0
    assert "online: buffer 160 tokens = " in r.stderr and "1 hf producer(s) through the Ray cluster at " \
        f"{cluster.address} on node " in r.stderr
    _same_run(in_process, out)


def _producer_pids(stderr: str) -> list[int]:
    import re

    return [int(p) for p in re.findall(r"Ray node \w+, pid (\d+)\)", stderr)]


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("launcher,producers", [("ddp", 1), ("ddp", 2), ("zero2", 1)])
def test_two_ranks_against_one_or_two_producers_train_as_the_target_in_process(
        launcher, producers, cluster, smol_prepared, tmp_path_factory, tmp_path):
    """Two ranks (DDP over gloo, or DeepSpeed ZeRO-2, on the CPU) with one producer, or two sharing
    every rank's stream, on the producer node: the same launch with the target in each rank's own
    process, to the bit."""
    zero2 = launcher == "zero2"
    ref = tmp_path_factory.getbasetemp() / f"{launcher}-in-process"
    if not (ref / "model.safetensors").is_file():
        r = _launch(_args(smol_prepared, ref, "overwrite=true", *(ZERO_OPT if zero2 else ())), ranks=2, zero2=zero2)
        assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "cluster"
    r = _launch(_args(smol_prepared, out, f"online.address={cluster.address}", PRODUCER,
                      f"online.data_parallel_size={producers}", *(ZERO_OPT if zero2 else ())), ranks=2, zero2=zero2)
    assert r.returncode == 0, r.stderr[-3000:]
    report = _report(out)
    assert report["world_size"] == 2
    assert report["distributed_type"] == ("DistributedType.DEEPSPEED" if zero2 else "DistributedType.MULTI_CPU")
    assert len({p["pid"] for p in report["final"]["online"]["producers"]}) == producers
    _same_run(ref, out)


def _cut_the_producer_node(cluster, cmd, out: Path, fault: dict) -> str:
    """The run started with the producer's test `fault` (it hands out no sample past the 4th:
    accelerate's loader fetches a batch ahead, so step 1 and its checkpoint are done and step 2
    waits); once checkpoint_1 is written the producer node's raylet is killed. The run's one
    error line, the node stopped (the caller starts it again)."""
    proc = subprocess.Popen([sys.executable, str(REPO / "recipes" / "train.py"), *cmd], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **ENV, **fault})
    try:
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "checkpoint_1").is_dir():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(proc.communicate()[1][-3000:])
            time.sleep(0.5)
        time.sleep(2)
        cluster.raylet("producers").kill()  # the producer node lost
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.stop("producers")
    assert proc.returncode != 0
    lines = [x for x in err.replace("\r", "\n").splitlines() if "error:" in x]
    assert len(lines) == 1, err[-3000:]
    print(lines[0])
    return lines[0]


@pytest.mark.slow
@pytest.mark.extended
def test_the_producer_node_lost_mid_run_is_one_line_and_the_run_resumes_to_the_same_weights(
        cluster, smol_prepared, in_process, tmp_path):
    """The producer hands out no sample past the 4th (accelerate's loader fetches a batch ahead:
    step 1 and its checkpoint are done, step 2 waits): its node's raylet is killed; the run ends in
    one line naming the node and what to run, and once a node with the resources is back,
    resume=latest ends with the uninterrupted run's weights."""
    out = tmp_path / "cut"
    cmd = _args(smol_prepared, out, f"online.address={cluster.address}", PRODUCER)
    line = _cut_the_producer_node(cluster, cmd, out, {STALL_AFTER_SAMPLES: "4"})
    assert "online: the hf producer 0 on node " in line and "its node left the Ray cluster" in line, line
    assert "resume=latest continues from checkpoint_1" in line and f"ray start --address={cluster.address}" in line
    cluster.start("producers", {"producer_node": 2}, cpus=1)
    r = _launch([*cmd, "resume=latest"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _sha(out / "model.safetensors") == _sha(in_process / "model.safetensors")


@pytest.mark.slow
@pytest.mark.extended
def test_a_trainer_that_dies_takes_its_producers_with_it(cluster, smol_prepared, tmp_path):
    """The trainer killed mid-run (no cleanup): Ray ends the producer actors it owned, their
    processes gone within seconds, nothing left holding the producer node's devices."""
    r = _launch(_args(smol_prepared, tmp_path / "o", f"online.address={cluster.address}", PRODUCER),
                {faults.TRAIN_AFTER_STEPS: "3"})
    assert r.returncode == faults.EXIT_CODE, r.stderr[-3000:]
    pids = _producer_pids(r.stderr)
    assert pids, r.stderr[-3000:]
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"producer processes {pids} outlived the trainer"
        time.sleep(0.5)


@pytest.mark.slow  # a Ray instance and two producer actors: over a minute on 2 cores
def test_two_producers_on_a_local_cluster_train_as_the_target_in_process(tiny_capture, tiny_target_dir, tmp_path,
                                                                        capsys):
    """online.data_parallel_size=2 with no cluster given: the first rank starts one here and two
    hf producers in it share the rank's stream; the run is the in-process run to the bit."""
    import ray

    prepared = tiny_capture.parent / "prepared"
    common = [f"data={prepared}", f"target={tiny_target_dir}", "max_steps=6", "epochs=3", "log_every=1",
              "batch_size=2", "save_every=1000", "warmup_steps=1", "online.engine=hf", "online.draft_vocab_size=64",
              "online.max_tokens_per_batch=1", "online.buffer_tokens=200"]
    ref = train.run(load_config(TrainConfig, TINY, [*common, f"output_dir={tmp_path / 'ref'}"]))
    try:
        two = train.run(load_config(TrainConfig, TINY, [*common, f"output_dir={tmp_path / 'two'}",
                                                        "online.data_parallel_size=2"]))
    finally:
        ray.shutdown()
    assert [h["loss"] for h in two["history"]] == [h["loss"] for h in ref["history"]]
    assert _sha(tmp_path / "two" / "model.safetensors") == _sha(tmp_path / "ref" / "model.safetensors")
    # both started and told where they run (the start line); which of them made the states is the
    # scheduler's affair: a producer that loads its target after the other has made them all reports none
    start = next(line for line in capsys.readouterr().err.splitlines() if "hf producer(s)" in line)
    assert "2 hf producer(s)" in start and start.count(", pid ") == 2, start
    assert 1 <= len(two["final"]["online"]["producers"]) <= 2



def _throttle(pid: int, stopped: float, running: float, until) -> None:
    """Slow process `pid` as a loaded node would: stopped `stopped` s in every `stopped + running` s
    (SIGSTOP, SIGCONT) until `until()` is true or it is gone."""
    import signal

    while not until():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(running)


def _slowed_run(side: str, cluster, prepared, out: Path) -> dict:
    """The cluster run with `side`'s process (the trainer, or the producer actor) throttled while
    it lasts; its final online line."""
    import threading

    log = out.parent / f"{side}-stderr.txt"
    cmd = _args(prepared, out, f"online.address={cluster.address}", PRODUCER)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(REPO / "recipes" / "train.py"), *cmd], cwd=REPO, text=True,
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **ENV})
        try:
            deadline = time.monotonic() + 600
            while not (pids := _producer_pids(log.read_text())):  # the start line names the producer's pid
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            victim = proc.pid if side == "trainer" else pids[0]
            t = threading.Thread(target=_throttle, args=(victim, 0.4, 0.2, lambda: proc.poll() is not None))
            t.start()
            proc.wait(timeout=600)
            t.join()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, log.read_text()[-3000:]
    line = _report(out)["final"]["online"]
    print(side, {k: line[k] for k in ("bound", "trainer_wait_s", "producer_blocked_s", "buffer_peak_tokens")})
    return line


@pytest.mark.slow
@pytest.mark.extended
def test_a_slow_node_is_back_pressure_and_waiting_never_growth(cluster, smol_prepared, in_process, tmp_path):
    """Each side's node made slow in turn while a run lasts (its process stopped two thirds of the
    time): with the trainer slow the producer is held back (it waits longer than when the producer
    is the slow one) and the buffer never holds more than online.buffer_tokens (a sample more, at
    most); with the producer slow the trainer waits longer than when it is the slow one, and the
    run log calls it producer-bound. Each run is the one-process run to the bit."""
    slow_trainer = _slowed_run("trainer", cluster, smol_prepared, tmp_path / "slow-trainer")
    slow_producer = _slowed_run("producer", cluster, smol_prepared, tmp_path / "slow-producer")
    for line in (slow_trainer, slow_producer):
        assert max(line["buffer_peak_tokens"]) <= 160 + 48, line
    assert slow_trainer["producer_blocked_s"] > slow_producer["producer_blocked_s"], (slow_trainer, slow_producer)
    assert slow_producer["trainer_wait_s"] > slow_trainer["trainer_wait_s"], (slow_trainer, slow_producer)
    assert slow_producer["bound"] == "producer-bound", slow_producer
    _same_run(in_process, tmp_path / "slow-trainer")
    _same_run(in_process, tmp_path / "slow-producer")


@pytest.mark.slow
@pytest.mark.extended
def test_a_vllm_producer_on_the_producer_node_trains_as_the_target_in_process(cluster, smol_prepared, in_process,
                                                                            tmp_path):
    """online.engine=vllm with online.producer_resources: the vLLM producer is started on the node
    that offers them (a Ray actor there starts the runner, whose states cross to the trainer's
    node), and the run trains as the one-process run does, within a vLLM capture's tolerance;
    its log comes back into the run's folder and nothing of it outlives the run."""
    from tests.conftest import require_vllm

    require_vllm()
    out = tmp_path / "vllm"
    r = _launch(_args(smol_prepared, out, f"online.address={cluster.address}", PRODUCER, "online.engine=vllm",
                      "online.target_dtype=float32", "online.concurrency=4"))
    assert r.returncode == 0, r.stderr[-3000:]
    nodes = cluster.node_ids()
    where = json.loads((out / ".online" / "producer-0.where.json").read_text())
    assert where["node"] == nodes["producer_node"] != nodes["trainer_node"], (where, nodes)
    assert "the vLLM producer runs the target in float32; 1 vLLM producer(s) through the Ray cluster at " \
        f"{cluster.address} on node " in r.stderr, r.stderr[-3000:]
    assert "vLLM" in (out / ".online" / "producer-0.log").read_text()
    assert not psutil.pid_exists(where["pid"]) or psutil.Process(where["pid"]).status() == psutil.STATUS_ZOMBIE
    ours = [h["loss"] for h in _report(out)["history"]]
    theirs = [h["loss"] for h in _report(in_process)["history"]]
    assert ours == pytest.approx(theirs, rel=1e-3), (ours, theirs)  # tests/test_vllm_data.py's tolerance


@pytest.mark.slow
@pytest.mark.extended
def test_a_trainer_that_dies_takes_its_vllm_producer_on_another_node_with_it(cluster, smol_prepared, tmp_path):
    """The trainer killed mid-run (no cleanup): Ray ends the producer's host actor with its owner,
    and the runner it started there (its child, PR_SET_PDEATHSIG) ends its process group: nothing
    of the producer runs on its node within 30 s."""
    from tests.conftest import require_vllm

    require_vllm()
    out = tmp_path / "o"
    r = _launch(_args(smol_prepared, out, f"online.address={cluster.address}", PRODUCER, "online.engine=vllm",
                      "online.target_dtype=float32"), {faults.TRAIN_AFTER_STEPS: "3"})
    assert r.returncode == faults.EXIT_CODE, r.stderr[-3000:]
    where = json.loads((out / ".online" / "producer-0.where.json").read_text())
    pids = [where["pid"], where["host_pid"]]
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"the vLLM producer {pids} outlived the trainer"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.extended
def test_the_vllm_producer_node_lost_mid_run_is_one_line_and_the_run_resumes(cluster, smol_prepared, in_process,
                                                                             tmp_path):
    """The vLLM producer on the producer node hands out no sample past the 4th (a test fault its
    host passes on); once the first checkpoint is written the node's raylet is killed: one line naming
    the node and the `ray start` to run, and with the node back, resume=latest ends as the
    one-process run does, within a vLLM capture's tolerance."""
    from tests.conftest import require_vllm

    require_vllm()
    out = tmp_path / "cut"
    cmd = _args(smol_prepared, out, f"online.address={cluster.address}", PRODUCER, "online.engine=vllm",
                "online.target_dtype=float32")
    line = _cut_the_producer_node(cluster, cmd, out, {"DRAFTSMITH_FAULT_PRODUCER_STALL_AFTER_SAMPLES": "4"})
    assert "online: the vLLM producer 0 on node " in line and "its node left the Ray cluster" in line, line
    assert "resume=latest continues from checkpoint_" in line and f"ray start --address={cluster.address}" in line
    cluster.start("producers", {"producer_node": 2}, cpus=1)
    r = _launch([*cmd, "resume=latest"])
    assert r.returncode == 0, r.stderr[-3000:]
    ours = {h["step"]: h["loss"] for h in _report(out)["history"]}
    theirs = {h["step"]: h["loss"] for h in _report(in_process)["history"]}
    assert max(ours) == 4 and [ours[k] for k in sorted(ours)] == pytest.approx([theirs[k] for k in sorted(ours)],
                                                                                rel=1e-3), (ours, theirs)
