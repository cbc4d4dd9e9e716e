"""Static checks of the Ansible code (the ``lint`` marker): in make test, not make unit."""
