"""Ask the installed vLLM whether it can serve a draft for a target architecture. Runs with the
Python of a vLLM environment (it imports only vllm and the standard library, never draftsmith):

    .vllm-venv/bin/python trainer/vllm/runners/vllm_servable.py --architectures LlamaForCausalLM [...] --out result.json
    .vllm-venv/bin/python trainer/vllm/runners/vllm_servable.py --all --out table.json     (every registered one)

An EAGLE-3, DFlash or DSpark draft reads the target's aux hidden states, which vLLM takes only
from a target class implementing `SupportsEagle3` (vllm/model_executor/models/interfaces.py;
the model runner raises "Model does not support EAGLE3 interface" otherwise). result.json:
{"vllm": version, "methods": the speculative methods this vLLM knows, "architectures":
{arch: {"registered": bool, "supports_eagle3": bool, "transformers_backend": bool, "plugin": bool}}}:
"plugin" where draftsmith's vLLM plugin (trainer/vllm/plugin/, installed beside vLLM) gives the
class its SupportsEagle3; "transformers_backend" where vLLM runs the target through its
Transformers backend (vllm/model_executor/models/transformers/), whose inner `model` is the HF
base model itself, so that a draft shares the target's embedding only where HF names it
`embed_tokens` or `embedding` (v1/spec_decode/llm_base_proposer.py, _maybe_share_embeddings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--architectures", nargs="*", default=[])
    ap.add_argument("--all", action="store_true", help="every architecture vLLM registers")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import vllm
    from vllm.config.speculative import SpeculativeMethod
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.plugins import load_general_plugins

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
    report = {"vllm": vllm.__version__, "methods": methods, "architectures": out}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    os.replace(tmp, args.out)
    print(json.dumps({k: v for k, v in out.items() if not args.all}), file=sys.stderr)


if __name__ == "__main__":
    main()
