"""What the tests share: the containerized cluster (cluster.py), Slurm hosts (slurm.py), this
checkout's fixed resources (testbed.py), job helpers (helpers.py), the CRD validator (k8s_validate.py)."""
