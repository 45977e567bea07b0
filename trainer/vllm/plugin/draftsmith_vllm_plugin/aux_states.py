"""vLLM's own classes of the families in FAMILIES (__init__.py), plus `SupportsEagle3`: the
residual stream entering each requested layer, as vLLM's Llama returns it
(interfaces.py, EagleModelMixin._maybe_add_hidden_state: hidden_states + residual, the bare
hidden states before the first layer), taken by forward pre-hooks on the decoder layers (and on
the final norm, which adds the last residual, for the state after the last layer), and returned
beside the hidden states as (hidden_states, [aux per layer, in layer order]). Pipeline
parallelism is not supported for these (the aux states are not carried between stages)."""

from __future__ import annotations

import torch
from vllm.model_executor.models import gemma2, gemma3
from vllm.model_executor.models.interfaces import SupportsEagle3


class AuxStates:
    """The mixin: hooks that keep the states entering the requested layers of `self.model`."""

    supports_aux_hidden_states_over_pp = False

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        for hook in getattr(self, "_aux_hooks", ()):
            hook.remove()
        self._aux_layers = tuple(sorted(set(int(i) for i in layers)))
        self._aux: dict[int, torch.Tensor] = {}
        model, hooks = self.model, []
        for i in self._aux_layers:
            if i < len(model.layers):  # args (positions, hidden_states, residual)
                hooks.append(model.layers[i].register_forward_pre_hook(self._keep(i, 1)))
            else:  # the final norm(hidden_states, residual): the state after the last layer
                hooks.append(model.norm.register_forward_pre_hook(self._keep(i, 0)))
        self._aux_hooks = hooks

    def _keep(self, i: int, at: int):
        def hook(_module, args):
            hidden, residual = args[at], args[at + 1] if len(args) > at + 1 else None
            self._aux[i] = hidden + residual if residual is not None else hidden

        return hook

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        n = len(self.model.layers)
        return (2, n // 2, n - 3)  # vLLM's own default (interfaces.py)

    def forward(self, *args, **kwargs):
        self._aux = {}
        hidden_states = super().forward(*args, **kwargs)
        if not getattr(self, "_aux_layers", ()):
            return hidden_states
        return hidden_states, [self._aux.pop(i) for i in self._aux_layers]


class Gemma3ForCausalLM(AuxStates, gemma3.Gemma3ForCausalLM, SupportsEagle3):
    pass


class Gemma2ForCausalLM(AuxStates, gemma2.Gemma2ForCausalLM, SupportsEagle3):
    pass
