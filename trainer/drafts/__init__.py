"""One module per draft algorithm: its config, the served nn.Module and its training step.

The registry is one dict: `DRAFTS[name]` -> the module implementing it.
"""

from trainer.drafts import eagle3

DRAFTS = {"eagle3": eagle3}
