"""The CPU diagnosis tool: ``rlalign-verl diagnose`` and ``rlalign-verl report``.

Kept apart from the worker-side library (patch, regions, profiles, families, metrics): the modules
here may import vLLM (the subprocess runner, the engine's ops) and matplotlib (the report's plots),
and nothing a training worker imports reaches into this package. This ``__init__`` stays empty so
``python -m rlalign_verl.tools.diagnose.runner`` pays only for what the runner itself needs.
"""
