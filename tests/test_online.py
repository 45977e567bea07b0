"""Online training (no capture on disk): the draft trains on states the target makes while it
trains. With the target in the trainer's process (online.engine=hf), in float32 and every
sample forwarded alone, a run is the capture-then-train run of the same seed and data to the
bit, for every algorithm: the same loss at every logged step and the same export; a killed
run resumes at the exact sample and ends with an uninterrupted run's weights. The channel a
separate producer streams through (Ray) applies back-pressure and never grows past its
buffer. The vLLM producer (a separate process, through Ray) is in tests/test_vllm_online.py."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch

from recipes import capture, export_draft, train
from tests.conftest import REPO
from trainer import faults
from trainer.config import CaptureConfig, ExportConfig, TrainConfig, load_config
from trainer.data.wire import encode
from trainer.errors import DraftsmithError
from trainer.online.channel import CLOSED, join_cluster, open_channel
from trainer.online.sources import ChannelSource, Watch
from trainer.vllm.online import served_dtype, settings_for

TINY = REPO / "recipes" / "configs" / "tiny"
# every sample forwarded alone on both sides: a sample's states are then the same arithmetic
ALONE = 1
COMMON = ["max_steps=6", "epochs=3", "log_every=1", "batch_size=2", "save_every=1000", "warmup_steps=1"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def exact_capture(tiny_capture, tmp_path_factory, tiny_target_dir):
    """The tiny capture's prepared data captured again with every sample forwarded alone, in float32."""
    out = tmp_path_factory.mktemp("online") / "capture"
    capture.run(CaptureConfig(data=str(tiny_capture.parent / "prepared"), output_dir=str(out),
                              target=str(tiny_target_dir), drafts=["eagle3", "dflash", "dspark"], samples_per_shard=8,
                              draft_vocab_size=64, store_dtype="float32", max_tokens_per_batch=ALONE))
    return out


def _train(algorithm, data, target_dir, out, *extra):
    return train.run(load_config(TrainConfig, TINY / f"{algorithm}.yaml",
                                 [f"data={data}", f"target={target_dir}", f"output_dir={out}", *COMMON, *extra]))


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
def test_online_hf_is_capture_then_train_to_the_bit(algorithm, exact_capture, tiny_target_dir, tmp_path):
    prepared = json.loads((exact_capture / "manifest.json").read_text())["data"]["path"]
    offline = _train(algorithm, exact_capture, tiny_target_dir, tmp_path / "offline")
    online = _train(algorithm, prepared, tiny_target_dir, tmp_path / "online", "online.engine=hf",
                    f"online.max_tokens_per_batch={ALONE}", "online.draft_vocab_size=64", "online.buffer_tokens=200")
    assert [h["loss"] for h in online["history"]] == [h["loss"] for h in offline["history"]]
    assert _sha(tmp_path / "online" / "model.safetensors") == _sha(tmp_path / "offline" / "model.safetensors")
    for name in ("offline", "online"):
        export_draft.run(ExportConfig(draft=str(tmp_path / name), output_dir=str(tmp_path / f"{name}-bf16")))
    assert _sha(tmp_path / "online-bf16" / "model.safetensors") == _sha(tmp_path / "offline-bf16" / "model.safetensors")
    line = online["final"]["online"]  # the run log says what the states cost
    assert line["producer_tokens_per_s"] > 0 and 0 <= line["trainer_waited"] <= 1


def test_a_second_epoch_reads_the_cache_and_trains_the_same(exact_capture, tiny_target_dir, tmp_path, capsys):
    """online.cache_tokens: the first epoch's states kept on local disk, the later epochs read
    them instead of running the target again; the run is the same to the bit. The run's start
    says what each rank's buffer costs."""
    prepared = json.loads((exact_capture / "manifest.json").read_text())["data"]["path"]
    offline = _train("eagle3", exact_capture, tiny_target_dir, tmp_path / "offline", "max_steps=16")
    capsys.readouterr()
    online = _train("eagle3", prepared, tiny_target_dir, tmp_path / "online", "max_steps=16", "online.engine=hf",
                    f"online.max_tokens_per_batch={ALONE}", "online.draft_vocab_size=64", "online.cache_tokens=100000")
    H = json.loads((tiny_target_dir / "config.json").read_text())["hidden_size"]
    bytes_per_token = (3 + 1) * H * 4 + 9  # 3 aux layers and the last, float32; id, mask, greedy token
    assert f"online: buffer 65,536 tokens = {65536 * bytes_per_token / 2**20:.1f} MiB per rank" \
        in capsys.readouterr().err
    assert [h["loss"] for h in online["history"]] == [h["loss"] for h in offline["history"]]
    one_epoch = json.loads((exact_capture / "manifest.json").read_text())["tokens"]
    assert online["final"]["online"]["tokens_received"] == one_epoch  # 16 steps x 2 samples = 2 epochs; one made
    assert not (tmp_path / "online" / ".online").exists() or not any((tmp_path / "online" / ".online").iterdir())


def _launch(args, env=None):
    return subprocess.run([sys.executable, str(REPO / "recipes" / "train.py"), *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=900,
                          cwd=REPO)


def test_a_killed_online_run_resumes_at_the_exact_sample(exact_capture, tiny_target_dir, tmp_path):
    """Killed at step 5 (the last checkpoint at step 4, inside a buffer window), run again with
    resume=latest: the weights of the uninterrupted run, to the bit."""
    prepared = json.loads((exact_capture / "manifest.json").read_text())["data"]["path"]
    args = ["--config", str(TINY / "eagle3.yaml"), f"data={prepared}", f"target={tiny_target_dir}", "online.engine=hf",
            "online.draft_vocab_size=64", "online.buffer_tokens=300", "max_steps=8", "epochs=4", "batch_size=2",
            "save_every=4", "log_every=1", "warmup_steps=1"]
    ref = _launch([*args, f"output_dir={tmp_path / 'ref'}"])
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = _launch([*args, f"output_dir={tmp_path / 'cut'}"], {faults.TRAIN_AFTER_STEPS: "5"})
    assert killed.returncode == faults.EXIT_CODE, killed.stderr[-2000:]
    resumed = _launch([*args, f"output_dir={tmp_path / 'cut'}", "resume=latest"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _sha(tmp_path / "cut" / "model.safetensors") == _sha(tmp_path / "ref" / "model.safetensors")


def test_a_full_buffer_holds_the_producer_back():
    """Each rank's buffer holds at most its capacity in tokens, counted when work is handed to a
    producer: what would not fit is held back (the sample the rank takes next always goes out),
    and taking one lets the next out. One rank's full buffer never holds back another rank's work:
    two ranks in one DDP step, rank 0 full and rank 1 starving, is the case where a producer that
    waited to deliver would deadlock. Samples reach a rank in its order whatever came first, and
    the producers' reports are summed."""
    join_cluster(None)
    try:
        channel = open_channel("test-backpressure", ranks=2, capacity_tokens=10)
        for rank in (0, 1):
            ray.get(channel.reset.remote(rank, 0, 0))
        ray.get(channel.request.remote(0, 0, [(0, 10, [1] * 6), (1, 11, [1] * 6), (2, 12, [1] * 3)]))
        ray.get(channel.request.remote(1, 0, [(0, 20, [1] * 6)]))

        def handed(most=8, timeout=0.3):
            return [(r[0], r[2]) for r in ray.get(channel.next_requests.remote(most, timeout))]

        def deliver(rank, seq, tokens):
            return ray.get(channel.deliver.remote(rank, 0, seq, {"seq": seq}, tokens))

        # rank 0: seq 0 (6 tokens) fits, seq 1 would make 12 > 10 and holds back seq 2 behind it;
        # rank 1's request, asked after both, still goes out
        assert handed() == [(0, 0), (1, 0)]
        assert handed() == []  # nothing more fits: a timeout, not a hang
        assert deliver(1, 0, 6) is True and ray.get(channel.take.remote(1, 1.0)) == {"seq": 0}
        assert deliver(0, 0, 6) is True
        assert ray.get(channel.status.remote())["reserved_tokens"] == [6, 0]
        assert ray.get(channel.take.remote(0, 1.0)) == {"seq": 0}  # taken: room for seq 1 and 2 (9 tokens)
        assert handed() == [(0, 1), (0, 2)]
        assert deliver(0, 2, 3) is True and deliver(0, 1, 6) is True  # out of order ...
        assert [ray.get(channel.take.remote(0, 1.0)) for _ in range(2)] == [{"seq": 1}, {"seq": 2}]  # ... in order
        assert ray.get(channel.take.remote(0, 0.2)) is None
        # a sample larger than the whole buffer still goes out when the rank needs it next
        ray.get(channel.request.remote(0, 0, [(3, 13, [1] * 25)]))
        assert handed() == [(0, 3)]
        ray.get(channel.report.remote({"pid": 1, "tokens": 100, "tokens_per_s": 50.0, "compute_s": 2.0,
                                       "blocked_s": 2.0}))
        ray.get(channel.report.remote({"pid": 2, "tokens": 60, "tokens_per_s": 30.0, "compute_s": 2.0,
                                       "blocked_s": 0.0}))
        together = ray.get(channel.status.remote())["producer"]
        assert together["producers"] == 2 and together["tokens"] == 160 and together["tokens_per_s"] == 80.0
        assert together["blocked_fraction"] == pytest.approx(2.0 / 6.0)  # waited 2 s of 6 s busy
    finally:
        ray.shutdown()


def test_an_unreachable_cluster_is_one_line_within_seconds():
    """online.address where no Ray cluster answers: one line naming the setting, within seconds
    (Ray alone retries for minutes, printing warnings)."""
    if ray.is_initialized():
        ray.shutdown()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(DraftsmithError) as err:
        join_cluster(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10 and not ray.is_initialized()
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"online.address=127.0.0.1:{port}: no Ray cluster answers"), line


@pytest.fixture(scope="module")
def cluster():
    if not ray.is_initialized():
        join_cluster(None)
    yield
    ray.shutdown()


SAMPLES = [{"input_ids": torch.tensor([1, 2, 3])} for _ in range(4)]  # a prepared set's rows, as a source reads them


def _taking(source, plan):
    """Start `source` taking its plan's first sample in a thread: (the thread, what it got: result
    or error, and when)."""
    got = {}
    source.begin(plan, 0)

    def take():
        try:
            got["result"] = source.take(plan[0])
        except DraftsmithError as err:
            got["error"] = str(err)
        got["at"] = time.monotonic()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, got


def test_every_rank_ends_in_one_line_within_seconds_when_the_producer_dies(cluster, tmp_path):
    """Only the first rank watches the producers (it started them); when one dies, every rank ends
    within seconds with the first rank's line (naming the producer and what to run), whatever the
    first rank was doing: two ranks waiting for states, a real process as the producer."""
    producer = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(2); sys.exit(17)"])
    channel = open_channel("test-producer-dies", ranks=2, capacity_tokens=100)
    first = Watch(lambda: f"the producer (pid {producer.pid}, exit {producer.returncode})",
                  lambda: "no checkpoint was written yet: run the same command again",
                  lambda: producer.poll() is None)
    other = Watch(lambda: "the producer of channel test-producer-dies", lambda: "see the first rank")
    sources = [ChannelSource(channel, 0, SAMPLES, 100, 600, 600, first),
               ChannelSource(channel, 1, SAMPLES, 100, 600, 600, other)]
    try:
        taking = [_taking(source, [rank]) for rank, source in enumerate(sources)]
        producer.wait()
        died = time.monotonic()
        for thread, got in taking:
            thread.join(15)
            assert not thread.is_alive() and got["at"] - died < 5, "a rank still waits"
            assert got["error"] == f"online: the producer (pid {producer.pid}, exit 17) died; no checkpoint was " \
                                   "written yet: run the same command again", got
    finally:
        for source in sources:
            source.close()


def test_a_closed_channel_ends_every_take_at_once(cluster):
    """A channel closed (the run, or its first rank, ended) answers every waiting `take` at once,
    with the reason given, and the ranks end in one line."""
    channel = open_channel("test-closed", ranks=2, capacity_tokens=100)
    for rank in (0, 1):
        ray.get(channel.reset.remote(rank, 0, 0))
    waiting = [channel.take.remote(rank, 60.0) for rank in (0, 1)]
    time.sleep(1)
    t0 = time.monotonic()
    ray.get(channel.close.remote("online: the first rank's line"))
    assert ray.get(waiting, timeout=10) == [(CLOSED, "online: the first rank's line")] * 2
    assert time.monotonic() - t0 < 5
    channel = open_channel("test-closed-plain", ranks=1, capacity_tokens=100)
    source = ChannelSource(channel, 0, SAMPLES, 100, 600, 600, Watch(lambda: "the producer", lambda: "run again"))
    thread, got = _taking(source, [0])
    time.sleep(1)
    ray.get(channel.close.remote())
    thread.join(10)
    assert not thread.is_alive() and "the run's channel was closed" in got["error"] and "\n" not in got["error"]


def test_the_timeout_counts_from_the_first_states_and_the_start_is_bounded_apart(cluster):
    """online.timeout_s counts only once the producer has handed this rank states: before that
    (its engine's start) online.start_timeout_s bounds the wait. Each ends the run in one line
    naming its setting."""
    channel = open_channel("test-timeouts", ranks=1, capacity_tokens=100)
    source = ChannelSource(channel, 0, SAMPLES, 100, 1, 30, Watch(lambda: "the producer", lambda: "run again"))
    thread, got = _taking(source, [0, 1])
    time.sleep(3)  # longer than timeout_s: an engine still starting
    assert thread.is_alive(), got
    handed = ray.get(channel.next_requests.remote(8, 1.0))
    assert [r[2] for r in handed] == [0, 1]
    ray.get(channel.deliver.remote(0, 0, 0, {**encode(SAMPLES[0]), "seq": 0, "index": 0}, 3))
    thread.join(5)
    assert not thread.is_alive() and torch.equal(got["result"]["input_ids"], SAMPLES[0]["input_ids"]), got
    t0 = time.monotonic()
    with pytest.raises(DraftsmithError, match=r"^online: the producer handed no states for \d+ s "
                                              r"\(online.timeout_s=1\); run again$"):
        source.take(1)
    assert time.monotonic() - t0 < 5
    channel = open_channel("test-start-timeout", ranks=1, capacity_tokens=100)
    source = ChannelSource(channel, 0, SAMPLES, 100, 600, 2, Watch(lambda: "the producer", lambda: "run again"))
    source.begin([0], 0)
    with pytest.raises(DraftsmithError, match=r"^online: the producer handed no first states for \d+ s "
                                              r"\(online.start_timeout_s=2: "):
        source.take(0)


def test_a_vllm_producer_runs_the_target_in_its_own_dtype(tmp_path):
    """online.target_dtype null: the dtype the target's config names (a 70B target in bfloat16 is
    not run in float32); set, it wins. The hf engine runs in the trainer's dtype: setting it is refused."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    cfg = load_config(TrainConfig, None, ["data=d", "output_dir=o", "online.engine=vllm"])
    assert cfg.online.target_dtype is None
    assert settings_for(cfg.online, [1, 2], 4, 64, served_dtype(tmp_path))["dtype"] == "bfloat16"
    cfg = load_config(TrainConfig, None, ["data=d", "output_dir=o", "online.engine=vllm",
                                          "online.target_dtype=float16"])
    assert settings_for(cfg.online, [1, 2], 4, 64, served_dtype(tmp_path))["dtype"] == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float16"}))
    assert served_dtype(tmp_path) == "float16"


@pytest.mark.parametrize("setting,expect", [
    (["online.engine=hf", "online.gpu_memory_utilization=0.5"], "are online.engine=vllm settings"),
    (["online.engine=hf", "online.tensor_parallel_size=2"], "are online.engine=vllm settings"),
    (["online.engine=vllm", "online.producer_resources={producer_node: 1}", "online.devices=[0]"],
     "online.devices names this machine's devices"),
    (["online.engine=vllm", "online.producer_resources={nowhere: 1}"],  # vLLM producers are placed the same way
     "online.producer_resources={\"nowhere\": 1}: the Ray cluster at "),
    (["online.engine=hf", "online.producer_resources={producer_node: 0}"],
     "online.producer_resources={producer_node: 0} (producer_node: 0); use > 0, or null (the Ray"),
    (["online.engine=hf", "online.producer_resources={nowhere: 1}"],  # a local cluster has none: not a hang
     "online.producer_resources={\"nowhere\": 1}: the Ray cluster at "),
    (["online.engine=vllm", "online.gpu_memory_utilization=1.5"],
     "online.gpu_memory_utilization=1.5; use in (0, 1], or null (vllm"),
    (["online.engine=vllm", "online.buffer_tokens=0"], "online.buffer_tokens=0; use >= 1"),  # the key given, alone
    (["online.engine=vllm", "online.concurrency=0"], "online.concurrency=0; use >= 1"),
    (["online.engine=ray"], "online.engine='ray'; use one of hf, vllm, or null"),
    (["online.engine=hf", "online.target_dtype=bfloat16"], "are online.engine=vllm settings"),
    (["online.engine=vllm", "online.start_timeout_s=0"], "online.start_timeout_s=0; use > 0"),
])
def test_an_online_setting_that_cannot_work_is_one_line(setting, expect, tiny_capture, tiny_target_dir, tmp_path,
                                                        capsys):
    from tests.test_bad_input import one_line_error

    argv = ["--config", str(TINY / "eagle3.yaml"), f"data={tiny_capture.parent / 'prepared'}",
            f"target={tiny_target_dir}", f"output_dir={tmp_path / 'out'}", *setting]
    try:
        one_line_error(capsys, train.main, argv, expect)
    finally:
        ray.shutdown()  # the local cluster the first rank started
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two Ray drivers: ~15 s
def test_a_second_rank_joins_the_cluster_the_first_started(tmp_path):
    """The first rank starts a Ray cluster here (online.address null), which checks a token (Ray
    2.60); another rank, not its child, joins it by address with what cluster_auth() shares and
    finds the first rank's named actor. Without it Ray refuses the join (InvalidAuthToken)."""
    first = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, ray; from trainer.online.channel import cluster_auth, join_cluster;\n"
        "address = join_cluster(None)\n"
        "@ray.remote\nclass A:\n    def hi(self): return 'hi'\n"
        "a = A.options(name='draftsmith-join-test', namespace='draftsmith').remote(); ray.get(a.hi.remote())\n"
        "print(json.dumps({'address': address, 'auth': cluster_auth()}), flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        shared = first.stdout.readline()
        second = subprocess.run([sys.executable, "-c", (
            "import json, sys, ray; from trainer.online.channel import find_channel, join_cluster, use_auth;\n"
            "run = json.loads(sys.argv[1]); use_auth(run['auth']); join_cluster(run['address'])\n"
            "print(ray.get(find_channel('draftsmith-join-test', 30).hi.remote()))"), shared],
            capture_output=True, text=True, cwd=REPO, timeout=120)
    finally:
        first.communicate(timeout=60)
    assert json.loads(shared)["auth"].get("RAY_AUTH_MODE") == "token"  # else this test proves nothing
    assert second.returncode == 0 and second.stdout.strip().endswith("hi"), second.stderr[-2000:]
