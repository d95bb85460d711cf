"""Hydra configs shipped with rlalign-verl (``pkg://rlalign_verl.configs``)."""
