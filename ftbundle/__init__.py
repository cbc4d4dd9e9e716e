"""ftbundle: make GPU servers ready with Ansible, then launch multi-node fine-tuning on them."""

__version__ = "0.1.0"
