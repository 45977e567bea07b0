"""Ask the installed vLLM whether it can serve a draft for a target architecture. Runs with the
Python of a vLLM environment (it imports only vllm and the standard library, never draftsmith):

    .vllm-venv/bin/python trainer/vllm/runners/vllm_servable.py --architectures LlamaForCausalLM [...] \
        [--configs TARGET_DIR ...] --out result.json
    .vllm-venv/bin/python trainer/vllm/runners/vllm_servable.py --all --out table.json     (every registered one)

An EAGLE-3, DFlash or DSpark draft reads the target's aux hidden states, which vLLM takes only
from a target class implementing `SupportsEagle3` (vllm/model_executor/models/interfaces.py, 0.32 and 0.34;
the model runner raises "Model does not support EAGLE3 interface" otherwise). result.json:
{"vllm": version, "methods": the speculative methods this vLLM knows, "architectures":
{arch: {"registered": bool, "supports_eagle3": bool, "transformers_backend": bool, "plugin": bool}}}:
"plugin" where draftsmith's vLLM plugin (trainer/vllm/plugin/, installed beside vLLM) gives the
class its SupportsEagle3; "transformers_backend" where vLLM runs the target through its
Transformers backend (vllm/model_executor/models/transformers/), whose inner `model` is the HF
base model itself, so that a draft shares the target's embedding only where HF names it
`embed_tokens` or `embedding` (v1/spec_decode/llm_base_proposer.py in vLLM 0.32, _maybe_share_embeddings).
With --configs, each target folder's config.json read as vLLM reads it at engine start
(vllm/transformers_utils/config.py get_config, 0.32 and 0.34, with this environment's transformers, which may be
older than draftsmith's): result.json's "configs" {folder: {"ok": bool, "error": its first line}}
and "transformers" (this environment's version).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import typing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--architectures", nargs="*", default=[])
    ap.add_argument("--all", action="store_true", help="every architecture vLLM registers")
    ap.add_argument("--configs", nargs="*", default=[], help="target folders whose config.json vLLM must read")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import vllm
    from vllm.config.speculative import SpeculativeMethod
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.plugins import load_general_plugins
    from vllm.transformers_utils.config import get_config

    load_general_plugins()  # as every vLLM process does: draftsmith's plugin (trainer/vllm/plugin/), if installed

    archs = sorted(ModelRegistry.get_supported_archs()) if args.all else args.architectures
    out = {}
    for arch in archs:
        row = {"registered": arch in ModelRegistry.get_supported_archs(), "supports_eagle3": False}
        if row["registered"]:
            try:
                cls = ModelRegistry._try_load_model_cls(arch)  # imports that one model module
                row["supports_eagle3"] = bool(cls is not None and supports_eagle3(cls))
                row["transformers_backend"] = bool(cls is not None and
                                                   cls.__module__.startswith("vllm.model_executor.models.transformers"))
                row["plugin"] = bool(cls is not None and cls.__module__.startswith("draftsmith_vllm_plugin"))
            except Exception as err:  # a model whose optional dependencies are absent here
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        out[arch] = row
    methods = sorted({m for m in typing.get_args(SpeculativeMethod) if isinstance(m, str)})
    configs = {}
    for folder in args.configs:  # as an engine start reads it (trust_remote_code off, as draftsmith's)
        try:
            get_config(folder, trust_remote_code=False)
            configs[folder] = {"ok": True}
        except Exception as err:  # whatever transformers or vLLM raise for a config they cannot read
            configs[folder] = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    report = {"vllm": vllm.__version__, "transformers": importlib.metadata.version("transformers"),
              "methods": methods, "architectures": out, "configs": configs}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    os.replace(tmp, args.out)
    print(json.dumps({k: v for k, v in out.items() if not args.all} | configs), file=sys.stderr)


if __name__ == "__main__":
    main()
