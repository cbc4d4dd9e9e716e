"""A real NVIDIA GPU (the ``gpu`` marker): run on a lent GPU machine by .ci/gpu-check.sh."""
