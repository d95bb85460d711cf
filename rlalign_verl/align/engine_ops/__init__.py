"""Adapters that run an engine's own ops inside the trainer (they import vLLM; opt-in variants only).

:mod:`.attention_op` (the ``attention`` region's ``engine-op``) and :mod:`.moe_op` (``moe_variant=engine-op``).
The rounding math every profile mirrors stays in :mod:`rlalign_verl.align.regions`.
"""
