"""Containerized hosts on a Docker engine (the ``cluster`` marker; some also train: ``train``)."""
