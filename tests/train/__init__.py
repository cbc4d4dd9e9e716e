"""Real LlamaFactory training on this machine, no Docker (the ``train`` marker)."""
