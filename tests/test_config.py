"""Typed configs: every YAML loads; typos, wrong types, missing keys and missing files
fail with one line naming the key and a non-zero exit, through the real entry points."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import capture, prepare
from tests.conftest import REPO
from trainer.config import SCHEMAS, CaptureConfig, ConfigError, PrepareConfig, load_config
from trainer.settings import setting

YAMLS = sorted((REPO / "recipes" / "configs").rglob("*.yaml"))


def test_there_are_configs():
    assert len(YAMLS) >= 5


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(REPO / "recipes" / "configs")))
def test_every_yaml_loads_and_opens_with_its_command(path):
    cfg = load_config(SCHEMAS[path.stem], path)
    assert cfg is not None
    first = path.read_text().splitlines()[0]
    rel = str(path.relative_to(REPO))
    assert first.startswith("# ") and (rel in first or "make demo" in first), first


def test_defaults_yaml_overrides_precedence(tmp_path):
    y = tmp_path / "p.yaml"
    y.write_text("output_dir: a\nmax_length: 100\n")
    cfg = load_config(PrepareConfig, y, ["max_length=200", "regenerate.enabled=true"])
    assert (cfg.output_dir, cfg.max_length, cfg.regenerate.enabled, cfg.source) == ("a", 200, True, "sharegpt")


def test_typo_gets_a_suggestion(tmp_path):
    y = tmp_path / "p.yaml"
    y.write_text("output_dir: a\nmax_lenght: 100\n")
    with pytest.raises(ConfigError, match=r"unknown key 'max_lenght'.*did you mean 'max_length'"):
        load_config(PrepareConfig, y)


def test_nested_typo_names_the_full_key():
    with pytest.raises(ConfigError, match=r"'regenerate.temprature'.*did you mean 'regenerate.temperature'"):
        load_config(PrepareConfig, None, ["output_dir=a", "regenerate.temprature=0.5"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"key 'max_length'"):
        load_config(PrepareConfig, None, ["output_dir=a", "max_length=long"])


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match=r"required key\(s\) data, output_dir not set"):
        load_config(CaptureConfig, None, [])


def test_cross_field_check():
    with pytest.raises(ConfigError, match="store_dtype='fp8'; use one of float32, bfloat16, float16, float8_e4m3 "
                       r"\(the dtype hidden states are stored in\)$"):
        load_config(CaptureConfig, None, ["data=a", "output_dir=b", "store_dtype=fp8"])
    assert load_config(CaptureConfig, None, ["data=a", "output_dir=b", "store_dtype=float8_e4m3"]).store_dtype \
        == "float8_e4m3"
    with pytest.raises(ConfigError, match="engine=vllm settings"):
        load_config(CaptureConfig, None, ["data=a", "output_dir=b", "tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="regenerate.engine='sglang'; use one of hf, vllm"):
        load_config(PrepareConfig, None, ["output_dir=a", "regenerate.engine=sglang"])
    with pytest.raises(ConfigError, match="leaves no room for a prompt"):
        load_config(PrepareConfig, None, ["output_dir=a", "regenerate.max_model_len=256"])  # = max_new_tokens
    with pytest.raises(ConfigError, match="regenerate.truncated='cut'; use one of keep, drop"):
        load_config(PrepareConfig, None, ["output_dir=a", "regenerate.truncated=cut"])


@pytest.mark.parametrize("main, argv, expect", [
    (prepare.main, ["output_dir=x", "max_lenght=5"],
     "error: override: unknown key 'max_lenght' for PrepareConfig; did you mean 'max_length' (tokens per "
     "conversation at most)?"),
    (prepare.main, ["output_dir=x", "num_proc=two"], "error: override: key 'num_proc'"),
    (capture.main, ["--config", "no/such.yaml"], "error: config file 'no/such.yaml' not found"),
    (capture.main, [], "error: required key(s) data, output_dir not set"),
])
def test_entry_points_print_one_line_and_exit_2(main, argv, expect, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(expect), err


def test_console_script_reports_config_errors(tmp_path):
    exe = Path(sys.executable).parent / "draftsmith"
    r = subprocess.run([str(exe), "capture", "data=a", f"output_dir={tmp_path}/o", "store_dtyp=bf16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    want = ("error: override: unknown key 'store_dtyp' for CaptureConfig; did you mean 'store_dtype' (the dtype "
            "hidden states are stored in)?")  # the suggestion quotes the setting's own help
    assert r.stderr.strip() == want
    r = subprocess.run([str(exe), "captur"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "did you mean 'capture'" in r.stderr


@dataclasses.dataclass
class _Bounded:
    count: int = setting(1, "how many", ge=1)
    share: float | None = setting(None, "a fraction; null: all", gt=0, le=1)
    mode: str = setting("a", "the mode", choices=("a", "b"))
    loads: list[int] = setting(help="loads", factory=lambda: [1, 4], ge=1)
    weights: dict[str, float] = setting(help="weights by name", factory=dict, gt=0)


@pytest.mark.parametrize("override, line", [
    ("count=0", "count=0; use >= 1 (how many)"),
    ("share=0", "share=0; use in (0, 1], or null (a fraction; null: all)"),
    ("share=1.5", "share=1.5; use in (0, 1], or null"),
    ("mode=c", "mode='c'; use one of a, b (the mode)"),
    ("loads=[1,0,4]", "loads=[1, 0, 4] (0); use >= 1 (loads)"),
    ("weights={x: 1, y: -2}", "weights={x: 1, y: -2} (y: -2); use > 0 (weights by name)"),
])
def test_a_setting_out_of_its_declared_bounds_is_one_line(override, line):
    """Bounds declared with the field (trainer/settings.py) are checked at load, for a list's elements
    and a dict's values too; a null optional is never checked; the line names key, value and rule."""
    assert load_config(_Bounded, None, ["share=1", "loads=[2]", "weights={x: 0.5}"]).share == 1.0
    assert load_config(_Bounded, None, ["share=null"]).share is None
    with pytest.raises(ConfigError) as e:
        load_config(_Bounded, None, [override])
    assert str(e.value).startswith(line), str(e.value)

