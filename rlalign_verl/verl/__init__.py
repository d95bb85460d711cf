"""verl integration: the ``verl.plugins`` entry point, the ``alignment`` config group and validation.

Import-light: verl loads :mod:`rlalign_verl.verl.plugin` in every process (driver, TaskRunner, FSDP
workers, inference servers).
"""
